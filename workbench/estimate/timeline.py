"""A GPU rank's memory through one step, in the order torch allocates and frees it, and its peak.

The step is walked at the moments that can hold the most: the end of the last micro-batch's forward (while the
loss's log_softmax runs), the loss's backward, the first block's backward (activations still all held, its
recomputation and gradients beside them), the end of backward (every gradient, no activations) and the
optimizer step. The peak is the largest of them, not the sum of every category: the activations are gone by
the time the optimizer's temporaries exist, and under FSDP2 the gradients do not exist yet at the loss.

What each moment holds (P: this rank's parameter elements after the tensor-parallel split):
- at rest: parameters (fp32; ÷dp under FSDP2, which reshards after backward at ZeRO 2 too), AdamW's moments
  (÷dp from ZeRO 1), DDP's gradient buckets, a pipeline stage's receive buffers;
- FSDP2's unsharded parameters: every one from the first forward to the end of backward at ZeRO 2; at ZeRO 3
  the root (this engine keeps it gathered, FSDP2's root rule) and two blocks (the one running and the one
  prefetched); in backward also the block's unsharded gradient and its reduce-scatter input (in the reduce
  dtype); with the embedding and the head units of their own (`Features.fsdp_edge_units`) the head's unit is
  gathered to its backward and the embedding's for its forward and again at backward's end;
- gradients: DDP's are whole (4·P) from the first backward until the optimizer has stepped (accumulated across
  micro-batches), FSDP2's sharded ones likewise, a pipeline's FSDP2 gradients whole until the step's sync;
- AdamW (torch's foreach implementation, torch/optim/adamw.py `_multi_tensor_adamw`): one temporary as large as
  the parameters it updates (the square root of the second moment) while it steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.estimate.data_parallel import dp_buffers, fsdp_edges
from workbench.estimate.model_state import engine_state_bytes, model_state_memory
from workbench.estimate.options import Dtypes, Features
from workbench.estimate.pipeline import peak_in_flight, receive_buffers
from workbench.estimate.saved_gpu import input_only, largest_rebuilt, loss_transients, stage_saved
from workbench.estimate.stage import Stage, ceil_div


@dataclass(frozen=True)
class Moments:
    """Bytes allocated at each moment of the step that can hold the most."""

    forward_end: int
    loss_backward: int
    first_block_backward: int
    backward_end: int
    optimizer_step: int

    @property
    def peak(self) -> int:
        return max(self.forward_end, self.loss_backward, self.first_block_backward, self.backward_end,
                   self.optimizer_step)

    @property
    def where(self) -> str:
        """Which moment holds the peak."""
        values = {"forward end": self.forward_end, "loss backward": self.loss_backward,
                  "first block's backward": self.first_block_backward, "backward end": self.backward_end,
                  "optimizer step": self.optimizer_step}
        return max(values, key=values.__getitem__)


@dataclass(frozen=True)
class GpuMemory:
    """One GPU rank's memory: each category at its own peak (what the telemetry reports per category) and the
    moments of the step (whose largest is what the caching allocator must have allocated at once)."""

    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int
    other: int
    moments: Moments
    host: int = 0


def gpu_memory(st: Stage, dt: Dtypes, features: Features) -> GpuMemory:
    cfg, m = st.cfg, st.shape
    dp, zero, mb = st.shard_ranks, cfg.zero, cfg.micro_batches
    fsdp = zero >= 2
    split = st.expert_params if cfg.ep > 1 else 0
    # Parameters at rest, gradients and moments: FSDP2 shards the parameters at ZeRO 2 as well (it only keeps
    # them gathered between forward and backward), so at rest ZeRO 2 and 3 hold the same.
    at_rest_zero = 3 if fsdp else zero
    state = engine_state_bytes(cfg.optimizer)
    states = [model_state_memory(st.params - split, dp, at_rest_zero, state),
              model_state_memory(split, cfg.dp // cfg.ep, at_rest_zero, state)]
    parameters, gradients, optimizer = (a + b for a, b in zip(*states))
    if fsdp and cfg.pp > 1:
        gradients = 4 * st.params  # accumulated whole within a pipeline until the step's sync
    host = 0
    if cfg.offload:
        # ZeRO-Offload (`offload.offloaded`): FSDP2's CPUOffloadPolicy keeps shards and moments on the host; the
        # host AdamW of ZeRO 0/1 keeps the moments and an fp32 master copy and a pinned gradient share there.
        if fsdp:
            host, parameters, gradients, optimizer = parameters + gradients + optimizer, 0, 0, 0
        else:
            share = ceil_div(4 * st.params, dp if zero == 1 else 1)
            host, optimizer = optimizer + 2 * share, 0
    buckets = dp_buffers(st) if zero <= 1 else 0  # DDP's flat gradient buckets, allocated once
    recv = receive_buffers(st) * dt.residual // 4
    at_rest = parameters + optimizer + buckets + recv

    # FSDP2's unsharded parameters and, in backward, one unit's unsharded gradient and its reduce-scatter input: a
    # block's while backward runs through the blocks (the head's gradient, made first, held beside it until the
    # root's reduce-scatter at backward's end), the root's (embedding, norm, head) at backward's end.
    apart = zero == 3 and features.fsdp_edge_units and bool(st.head)  # the head a unit of its own
    kept, resharded = fsdp_edges(st, apart)
    blocks = min(2, len(st.layers)) * st.block_params
    if zero == 2:
        gathered_fwd = gathered_bwd = dt.gathered_bytes(st.params, st.root)
    elif zero == 3:
        gathered_fwd = gathered_bwd = dt.gathered_bytes(blocks + kept, kept)
    else:
        gathered_fwd = gathered_bwd = 0
    grad_bytes = (dt.compute + 4) if fsdp and dt.mixed_precision else 4 if fsdp else 0
    head_grad = (dt.compute if dt.mixed_precision else 4) * (st.head if st.last else 0) if fsdp else 0
    block_grads = grad_bytes * (st.block_params if st.layers else 0) + head_grad
    root_grads = grad_bytes * st.root
    gathered_end = gathered_bwd
    if apart:
        # The embedding and the head units of their own (Features.fsdp_edge_units): the head's unit, resharded once
        # its backward is done, leaves only its fp32 reduce-scatter input beside the blocks' backward (held until
        # the next unit's reduce); at backward's end the embedding (first stage) is gathered again, its gradient
        # made, and the first block's reduce-scatter input is the one held.
        gathered_bwd = dt.gathered * blocks
        block_grads = grad_bytes * (st.block_params if st.layers else 0) + 4 * kept
        gathered_end = dt.gathered_root * resharded
        root_grads = grad_bytes * resharded + 4 * (st.block_params if st.layers else 0)
    unit_grads = max(block_grads, root_grads)

    saved = stage_saved(st, dt, features)
    activations = peak_in_flight(st, saved)
    earlier_grads = gradients if mb > 1 else 0  # accumulation: the first micro-batches' gradients are held
    loss_fwd, loss_bwd = loss_transients(st, dt, features)
    rebuild = largest_rebuilt(st, dt, features)
    optimizer_temp = 0 if cfg.offload else ceil_div(4 * st.params, dp if zero >= 1 else 1)

    moments = Moments(
        forward_end=at_rest + earlier_grads + activations + gathered_fwd + loss_fwd,
        loss_backward=at_rest + earlier_grads + activations + gathered_fwd + loss_bwd,
        first_block_backward=at_rest + earlier_grads + activations + gathered_bwd + block_grads + rebuild,
        backward_end=at_rest + gradients + gathered_end + root_grads + (input_only(st, dt) if st.layers else 0),
        optimizer_step=at_rest + gradients + optimizer_temp,
    )
    return GpuMemory(parameters=parameters, gradients=gradients, optimizer=optimizer,
                     buffers=buckets + recv + max(gathered_fwd, gathered_bwd, gathered_end) + unit_grads,
                     activations=activations, other=max(loss_fwd, loss_bwd, rebuild, optimizer_temp),
                     moments=moments, host=host)
