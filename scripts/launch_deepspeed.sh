#!/usr/bin/env bash
# Start `deinfer-megatron generate` (or another command) on TP×PP ranks with the DeepSpeed launcher.
#
#   scripts/launch_deepspeed.sh NPROC generate --model DIR --tp 2 --engine deepspeed --prompt "Hello"
#
# Multi-node: pass a hostfile with HOSTFILE=path (DeepSpeed's `--hostfile`); NPROC is the number
# of ranks per node. On CPU the launcher counts "GPUs" as ranks; each rank finds the RANK /
# WORLD_SIZE the launcher sets and joins. The launcher prints its own lines to stdout, beside the
# ranks': on one machine, `deinfer-megatron generate --launcher deepspeed ... --json` keeps stdout
# to the JSON document (docs/FAILURES.md, "Machine-readable output").
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="${DEINFER_BIN:-$here/.venv/bin}"
nproc="${1:?usage: launch_deepspeed.sh NPROC COMMAND [ARGS...]}"; shift
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
extra=()
[[ -n "${HOSTFILE:-}" ]] && extra+=(--hostfile "$HOSTFILE")
exec "$bin/deepspeed" "${extra[@]}" --num_gpus "$nproc" --master_port "${MASTER_PORT:-29500}" \
    --no_local_rank "$bin/deinfer-megatron" "$@"
