"""One rank's memory by category, assembled from the subjects' modules."""

from __future__ import annotations

from workbench.estimate.activations import rebuilt_block, stage_activations
from workbench.estimate.data_parallel import dp_buffers
from workbench.estimate.model_state import engine_state_bytes, model_state_memory
from workbench.estimate.offload import offloaded
from workbench.estimate.pipeline import peak_in_flight, receive_buffers
from workbench.estimate.records import Memory
from workbench.estimate.stage import Stage


def stage_memory(st: Stage) -> Memory:
    cfg, m = st.cfg, st.shape
    # The loss reads the logits: bf16 logits plus their fp32 copy under autocast, fp32 logits otherwise.
    vocab = st.profile.vocab_size if st.profile is not None else m.vocab_size
    other = st.tokens * vocab * (6 if st.autocast else 4) if st.last else 0
    other += rebuilt_block(st)
    # Expert slices are synchronised and sharded over edp = dp/ep, everything else over dp·cp (one shard group
    # under HSDP), with the optimizer's own state bytes.
    split_experts = st.expert_params if cfg.ep > 1 else 0
    state = engine_state_bytes(cfg.optimizer)
    dense = model_state_memory(st.params - split_experts, st.shard_ranks, cfg.zero, state)
    sliced = model_state_memory(split_experts, cfg.dp // cfg.ep, cfg.zero, state)
    parameters, gradients, optimizer = (a + b for a, b in zip(dense, sliced))
    memory = Memory(
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        buffers=dp_buffers(st) + receive_buffers(st),
        activations=peak_in_flight(st, stage_activations(st)),
        other=other,
    )
    return offloaded(memory, cfg, 4 * st.params, st.sync) if cfg.offload else memory
