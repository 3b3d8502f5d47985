#!/bin/bash
# The issue-10 measurements of docs/BENCHMARKS.md ("second run"), one command after the other.
# Run on a quiet machine (nothing else on its cores), as root for the two-namespace cells, from
# the repository root with the project's venv on PATH. The cost table is calibrated fresh into a
# new cache folder (removed at the end), so that `auto` prices with this machine as it is now.
# Writes docs/bench/llama-1b-{peers,predict,netns-1gbit,netns-10gbit,predict-2048}.* and prints
# scripts/check_core_scaling.py's tables.
set -euo pipefail
export OMP_NUM_THREADS=1
DEINFER_MEGATRON_CACHE=$(mktemp -d -t deinfer-bench-cache-XXXXXX)
export DEINFER_MEGATRON_CACHE
trap 'rm -rf "$DEINFER_MEGATRON_CACHE"' EXIT
stamp() { echo "== $(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >&2; }
model=(--synthetic llama-1b-shape --ratio 0.6 --tp 2)

stamp "TP=2 against the peers"
deinfer-megatron bench "${model[@]}" --batch 8 --prompt-len 128 --gen-len 32 --repeats 3 \
  --layouts naive,deinfer,auto,dense --peers hf,deepspeed --roofline --profile --predict --no-progress \
  --json docs/bench/llama-1b-peers.json --markdown docs/bench/llama-1b-peers.md
stamp "the matrix at context 128"
deinfer-megatron bench "${model[@]}" --batch 1,8,32 --prompt-len 128 --gen-len 32 --repeats 3 \
  --layouts auto,dense,naive,deinfer --predict --profile --no-progress \
  --json docs/bench/llama-1b-predict.json --markdown docs/bench/llama-1b-predict.md
for rate in 1gbit 10gbit; do
  stamp "across two namespaces at $rate"
  python -m tests.helpers.netns_bench --synthetic llama-1b-shape --rate $rate --batch 8,32 --gen-len 16 \
    --repeats 3 --layouts auto,naive,deinfer,dense --predict --json docs/bench/llama-1b-netns-$rate.json
done
stamp "matrix products only: one thread, two threads, two ranks"
for args in "--layout naive" "--layout deinfer" "--layout naive --dtype bfloat16"; do
  # shellcheck disable=SC2086
  PYTHONPATH=. python scripts/check_core_scaling.py $args
done
stamp "the matrix at context 2048"
deinfer-megatron bench "${model[@]}" --batch 1,8 --prompt-len 2048 --gen-len 32 --repeats 3 \
  --layouts auto,dense,naive,deinfer --predict --no-progress \
  --json docs/bench/llama-1b-predict-2048.json --markdown docs/bench/llama-1b-predict-2048.md
stamp done
