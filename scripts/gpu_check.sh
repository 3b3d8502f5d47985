#!/usr/bin/env bash
# GPU checks in under 5 minutes: layout parity on CUDA (NCCL; TP=2 when two GPUs exist), greedy
# generation (the project's loop and Megatron's engine), and a tiny `bench --synthetic
# llama-tiny` smoke. Run from anywhere on a machine with a CUDA GPU:
#
#     scripts/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# Every step runs under its own time limit; the script goes on after a failure, prints one
# line per step and exits non-zero if any failed (2: no CUDA device visible to torch).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT_DIR=${OUT:-$(mktemp -d)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False); nothing to check" >&2
    exit 2
fi
"$PYTHON" -c 'import torch; print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'

status=0
summary=()
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        summary+=("ok      $name ($((SECONDS - start)) s)")
    else
        status=1
        summary+=("FAILED  $name (exit $rc after $((SECONDS - start)) s; 124: over its ${limit} s limit)")
    fi
}

step "parity and generation on CUDA (tests/gpu)" 180 \
    "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/gpu
step "bench smoke (llama-tiny, dense + deinfer, TP=1)" 90 \
    "$PYTHON" -m deinfer_megatron.cli.main bench --synthetic llama-tiny --layouts dense,deinfer --tp 1 \
    --batch 1 --prompt-len 16 --gen-len 4 --repeats 1 --no-progress --json "$OUT_DIR/bench.json"
step "bench cells all measured" 15 \
    "$PYTHON" -c 'import json, sys; c = json.load(open(sys.argv[1]))["counts"]; print(c)
sys.exit(0 if c["ok"] > 0 and c["error"] == 0 else 1)' "$OUT_DIR/bench.json"

printf '%s\n' "${summary[@]}"
echo "gpu_check: $([ "$status" -eq 0 ] && echo passed || echo FAILED); outputs in $OUT_DIR"
exit "$status"
