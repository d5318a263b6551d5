#!/usr/bin/env bash
# dp2·zero3·bf16-fsdp: 2 ranks as 1 node(s) x 2 (cpu).
# Run on every node, e.g. NODE_RANK=1 MASTER_ADDR=node0 ./run.sh ; extra arguments go to workbench.train
# (--resume ckpt/ continues from the latest checkpoint, one a notebook's bench.save() wrote included).
# The rendezvous store listens on MASTER_PORT of the first node: keep that port inside the cluster's network.
set -euo pipefail
cd "$(dirname "$0")"
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
exec ${PYTHON:-python} -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --node-rank=$NODE_RANK --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT -m workbench.train config.json --steps 8 --save-every 4 --save-to ckpt --metrics metrics.jsonl --device cpu "$@"
