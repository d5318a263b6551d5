#!/usr/bin/env bash
# torchtitan (0.3) run nearest to the workbench layout dp2·zero3·bf16-fsdp: 2 ranks as 1 node(s)
# x 2. Run on every node, e.g. NODE_RANK=1 MASTER_ADDR=node0 ./torchtitan.sh ; extra arguments
# (--section.key value) go to torchtitan after these, overriding them. torchtitan needs its tokenizer
# (--hf_assets_path) and dataset.
# Not expressible in torchtitan's config (the workbench's value is in config.json):
#   - model shape tiny (853,120 parameters, vocab 256): torchtitan's llama3 flavors are fixed shapes with a trained tokenizer; flavor 8B is written, edit it or add a flavor
#   - byte-level tokens and the workbench's corpus: torchtitan reads a tokenizer (--hf_assets_path, a folder holding tokenizer.json) and a dataset
set -euo pipefail
cd "$(dirname "$0")"
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
exec ${PYTHON:-python} -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --node-rank=$NODE_RANK --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT -m torchtitan.train \
    --module llama3 \
    --config llama3_8b \
    --training.local_batch_size 2 \
    --training.global_batch_size 8 \
    --training.seq_len 64 \
    --training.steps 8 \
    --training.mixed_precision_param bfloat16 \
    --training.mixed_precision_reduce float32 \
    --training.max_norm 1000000000.0 \
    --parallelism.data_parallel_replicate_degree 1 \
    --parallelism.data_parallel_shard_degree 2 \
    --parallelism.fsdp_reshard_after_forward always \
    --parallelism.tensor_parallel_degree 1 \
    --parallelism.pipeline_parallel_degree 1 \
    --parallelism.context_parallel_degree 1 \
    --parallelism.context_parallel_load_balancer headtail \
    --optimizer.param_groups.0.optimizer_kwargs.lr 0.003 \
    --optimizer.param_groups.0.optimizer_kwargs.weight_decay 0.0 \
    --lr_scheduler.warmup_steps 0 \
    --lr_scheduler.min_lr_factor 1.0 \
    --debug.seed 0 \
    --checkpoint.enable \
    --checkpoint.interval 4 \
    --optimizer.param_groups.0.optimizer_kwargs.betas 0.9 0.999 "$@" \
    activation-checkpoint:none
