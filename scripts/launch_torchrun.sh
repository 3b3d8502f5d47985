#!/usr/bin/env bash
# Start `deinfer-megatron generate` (or another command) on TP×PP ranks with torchrun.
#
#   scripts/launch_torchrun.sh NPROC generate --model DIR --tp 2 --prompt "Hello"
#
# Multi-node: set NNODES, NODE_RANK and MASTER_ADDR (and MASTER_PORT) on every node; NPROC is
# the number of ranks per node. Each rank finds torchrun's RANK/WORLD_SIZE and joins.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${DEINFER_PYTHON:-$here/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
nproc="${1:?usage: launch_torchrun.sh NPROC COMMAND [ARGS...]}"; shift
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$python" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" --node-rank="${NODE_RANK:-0}" --nproc-per-node="$nproc" \
    --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
    --max-restarts=0 -m deinfer_megatron.cli.main "$@"
