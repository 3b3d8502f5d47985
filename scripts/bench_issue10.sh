#!/bin/bash
# The issue-10 measurements of docs/BENCHMARKS.md ("The whole matrix"), one command after the
# other: the peers at the target cell, then TP=2 × batch {1, 8, 32} × context {128, 2048} × link
# {local, 10 Gbit/s, 1 Gbit/s} under every layout and `auto`, each cell with the cost model's
# prediction. Run on a quiet machine (nothing else on its cores), as root for the two-namespace
# cells, from the repository root with the project's venv on PATH. The cost table is calibrated
# fresh into a new cache folder (removed at the end), so that `auto` prices with this machine as
# it is now. Context-2048 cells take one timed run after the warm-up and 16 new tokens (a batch-32
# prefill of 2048 tokens is minutes a layout on these cores). Writes docs/bench/llama-1b-{peers,
# predict,netns-1gbit,netns-10gbit}.*, and at context 2048 llama-1b-{predict,netns-1gbit,
# netns-10gbit}-2048{,-b32}.*, and prints scripts/check_core_scaling.py's tables.
set -euo pipefail
export OMP_NUM_THREADS=1
DEINFER_MEGATRON_CACHE=$(mktemp -d -t deinfer-bench-cache-XXXXXX)
export DEINFER_MEGATRON_CACHE
trap 'rm -rf "$DEINFER_MEGATRON_CACHE"' EXIT
stamp() { echo "== $(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >&2; }
# a command whose cells failed (bench exits 1; the failures are in its JSON) does not end the run
goes_on() { "$@" || stamp "exit status $? (failed cells are recorded in the JSON)"; }
model=(--synthetic llama-1b-shape --ratio 0.6 --tp 2)
layouts=auto,naive,deinfer,dense

stamp "TP=2 against the peers"
goes_on deinfer-megatron bench "${model[@]}" --batch 8 --prompt-len 128 --gen-len 32 --repeats 3 \
  --layouts naive,deinfer,auto,dense --peers hf,deepspeed --roofline --profile --predict --no-progress \
  --json docs/bench/llama-1b-peers.json --markdown docs/bench/llama-1b-peers.md
stamp "local ranks, context 128"
goes_on deinfer-megatron bench "${model[@]}" --batch 1,8,32 --prompt-len 128 --gen-len 32 --repeats 3 \
  --layouts $layouts --predict --profile --no-progress \
  --json docs/bench/llama-1b-predict.json --markdown docs/bench/llama-1b-predict.md
for rate in 1gbit 10gbit; do
  stamp "across two namespaces at $rate, context 128"
  goes_on python -m tests.helpers.netns_bench --synthetic llama-1b-shape --rate $rate --batch 1,8,32 --gen-len 16 \
    --repeats 3 --layouts $layouts --predict --json docs/bench/llama-1b-netns-$rate.json
done
stamp "matrix products only: one thread, two threads, two ranks"
for args in "--layout naive" "--layout deinfer" "--layout naive --dtype bfloat16"; do
  # shellcheck disable=SC2086
  PYTHONPATH=. python scripts/check_core_scaling.py $args
done
# context 2048: batches 1 and 8 first on every link, then batch 32 (the longest prefills) last
stamp "local ranks, context 2048, batch 1 and 8"
goes_on deinfer-megatron bench "${model[@]}" --batch 1,8 --prompt-len 2048 --gen-len 16 --repeats 1 \
  --layouts $layouts --predict --no-progress \
  --json docs/bench/llama-1b-predict-2048.json --markdown docs/bench/llama-1b-predict-2048.md
for rate in 1gbit 10gbit; do
  stamp "across two namespaces at $rate, context 2048, batch 1 and 8"
  goes_on python -m tests.helpers.netns_bench --synthetic llama-1b-shape --rate $rate --batch 1,8 --prompt-len 2048 \
    --gen-len 16 --repeats 1 --layouts $layouts --predict --json docs/bench/llama-1b-netns-$rate-2048.json
done
stamp "local ranks, context 2048, batch 32"
goes_on deinfer-megatron bench "${model[@]}" --batch 32 --prompt-len 2048 --gen-len 16 --repeats 1 \
  --layouts $layouts --predict --no-progress \
  --json docs/bench/llama-1b-predict-2048-b32.json --markdown docs/bench/llama-1b-predict-2048-b32.md
# On a 24 GB machine naive and dense (and a plan with naive MLPs) run out of memory in this
# prefill (65,536 tokens in one forward, two ranks): only auto and deinfer go across the link.
for rate in 1gbit 10gbit; do
  stamp "across two namespaces at $rate, context 2048, batch 32"
  goes_on python -m tests.helpers.netns_bench --synthetic llama-1b-shape --rate $rate --batch 32 --prompt-len 2048 \
    --gen-len 16 --repeats 1 --layouts auto,deinfer --predict --json docs/bench/llama-1b-netns-$rate-2048-b32.json
done
stamp done
