"""Data parallel and the ZeRO stages, with torch's own building blocks.

    zero=0  DDP: every rank holds everything; gradients all-reduced in buckets during backward
            (with tp > 1 or a zero-bubble pipeline schedule: torch's FSDP2-based `replicate`, same
            semantics, see below and engine/parallel/pipeline.py).
    zero=1  DDP + ZeroRedundancyOptimizer: as 0, but each rank keeps (and updates) the
            optimizer state of its 1/dp share of the parameters, then broadcasts them.
    zero=2  FSDP2 with reshard_after_forward=False: parameters gathered once per step and kept
            until backward is done; gradients reduce-scattered, optimizer state sharded.
    zero=3  FSDP2: parameters also freed after each block's forward and gathered again in backward.

Everything works over the ranks that hold the same weights (`gradient_mesh`):
the "dp" axis, or with context parallel "dp_cp" (the cp ranks of a replica
computed their gradients from other tokens of the same sequences, so they
average them with the dp ranks, as torchtitan's FSDP over "dp_shard_cp").
HSDP (zero 2/3 with 1 < dp_replicate < dp) gives FSDP2 a 2-D mesh
(dp_replicate, dp_shard): parameters sharded within each shard group,
replicated across the groups; gradients reduce-scattered within a group, then
all-reduced across groups. With tp > 1 the
parameters are already DTensors on the tp axis, and the classic wrappers
predate DTensor (torch 2.13): DDP's initial broadcast fails on them, and its
built-in workaround (DDP on a mesh slice) drops the parameters from the module
after the first forward, so nothing could be saved or resharded. So with
tensor parallel, zero=0 uses torch's FSDP2-based `replicate` (the same DDP
semantics: replicated parameters, all-reduced gradients) and FSDP2 turns the
TP DTensors into 2-D (dp, tp) ones. ZeroRedundancyOptimizer cannot update
DTensors at all; `Config` refuses zero=1 with tp > 1.

Expert-parallel slices (ep > 1, engine/parallel/expert.py) differ across the
ep ranks, so they are kept out of the dp-wide synchronisation and synchronised
over the "edp" axis (`expert_mesh`) instead: DDP ignores them and a gradient
hook averages them over edp; with ZeRO-2/3 each layer's experts are their
own FSDP2 unit sharded over edp (expert.py says why a mean over edp is right).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from workbench.config import Config
from workbench.models.protocol import CausalLM
from workbench.engine.parallel.compression import apply_compression, fsdp_reduce_dtype
from workbench.engine.optimizers import OPTIMIZERS, hyperparameters
from workbench.engine.parallel.offload import HostOffload
from workbench.engine.parallel.zero_redundancy import zero_redundancy
from workbench.schedules import splits_backward


def gradient_mesh(mesh: DeviceMesh, cfg: Config) -> DeviceMesh:
    """The ranks that hold the same dense weights and average their gradients: "dp", "dp_cp" with context
    parallel; under HSDP the 2-D (dp_replicate, dp_shard[_cp]) mesh FSDP2 replicates over and shards within."""
    if cfg.hsdp:
        return mesh["dp_replicate", "dp_shard_cp" if cfg.cp > 1 else "dp_shard"]
    return mesh["dp_cp" if cfg.cp > 1 else "dp"]


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, cfg: Config,
              expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Replicate `model` over the dp axis; gradients all-reduced during backward."""
    if any(isinstance(p, DTensor) for p in model.parameters()) or splits_backward(cfg):
        # Under a zero-bubble schedule torch 2.13 computes weight gradients with autograd.grad and writes
        # `.grad` itself, past DDP's hooks: DDP never all-reduces them. `replicate` reduces in the
        # schedule's REDUCE_GRAD step (measured: DDP 2e-3 off one process, replicate 1.3e-7).
        return _replicate_dtensor_model(model, dp_mesh)
    # Buffers are never synced: the only one is the rotary table, built on every rank from the Config, and under
    # context parallel each rank's holds its own positions, which DDP's initial broadcast from rank 0 would overwrite.
    ignored = [name for name, _ in model.named_buffers()]
    if expert_mesh is not None:
        from workbench.engine.parallel.expert import expert_modules, sync_expert_gradients_with_hooks

        ignored += [f"{name}.{p}" for name, m in expert_modules(model) for p, _ in m.named_parameters()]
        sync_expert_gradients_with_hooks(model, expert_mesh)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    # process_group, not device_mesh: given a slice of a larger mesh, DDP applies its TP workaround.
    device_ids = None if dp_mesh.device_type == "cpu" else [torch.accelerator.current_device_index()]
    # No buffer sync before each forward either: it would add a collective per step that the timeline shows.
    # init_sync=False: no shape check and broadcast from rank 0 at construction; every rank built the same weights
    # from the same Config and seed (and a reshard then writes the same state into each replica).
    ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids, init_sync=False,
                                  **{_NO_BUFFER_SYNC: False})
    # Gradient compression is a comm hook: it replaces DDP's bucket all-reduce (Config.compression).
    apply_compression(ddp, dp_mesh.get_group(), cfg)
    return ddp


# torch 2.13 renamed broadcast_buffers (now deprecated, with a warning) to forward_sync_buffers.
_NO_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")


def _replicate_dtensor_model(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    # Private in torch 2.13, but torch's own DDP for DTensor parameters, built on FSDP2's machinery.
    from torch.distributed._composable.replicate_with_fsdp import replicate

    # One unit per block, like DDP's gradient buckets: a block's all-reduce starts as soon as its
    # backward is done, overlapping the backward of the blocks before it.
    for block in model.block_modules.values():
        replicate(block, mesh=dp_mesh)
    return replicate(model, mesh=dp_mesh)


def apply_fsdp(model: CausalLM, dp_mesh: DeviceMesh, cfg: Config,
               expert_mesh: DeviceMesh | None = None) -> CausalLM:
    """Shard each block, then the root (embedding, final norm, output head), across the dp axis."""
    # Under tensor parallel the root returns the logits as a view of a DTensor's local tensor; FSDP2
    # warns that in-place ops on it would skip its hook. The loss only reads the logits: not our case.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # One FSDP unit per block: a block's parameters are gathered just before it runs and its
    # gradients reduce-scattered just after its backward, overlapping communication with the
    # neighbouring blocks' computation. ZeRO-2 keeps gathered parameters from forward to backward.
    per_block = cfg.zero == 3
    policies = _fsdp_policies(dp_mesh, cfg)
    if expert_mesh is not None:
        from workbench.engine.parallel.expert import expert_modules

        # First, so each block's unit below leaves the expert slices to theirs (sharded over edp only).
        for _, experts in expert_modules(model):
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=per_block, **policies)
    for block in model.block_modules.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=per_block, **policies)
    # The root's parameters are used first thing in backward (the output head), so resharding them
    # after forward would only gather them again at once: None lets FSDP2 keep them (root rule).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=None if per_block else False, **policies)
    return model


def _fsdp_policies(dp_mesh: DeviceMesh, cfg: Config) -> dict:
    """FSDP2's knobs for Config.mixed_precision, Config.compression and Config.offload (zero 2/3).

    mixed_precision "fsdp": parameters cast to bf16 as they are gathered (the compute runs in bf16, the fp32
    shards stay the master copy), gradients reduced in fp32 unless compression says fp16/bf16; FSDP2 would
    otherwise reduce in the parameters' bf16. compression "fp16"/"bf16" alone: gradients reduce-scattered in that
    dtype (parameters stay fp32; the precision setting is autocast's business). offload: CPUOffloadPolicy keeps
    the parameter and gradient shards and so the optimizer state and step on the host; each all-gather first
    copies the shard to the device (pinned memory on CUDA). That offloads more than ZeRO-Offload (which keeps
    fp16 parameters on the device), traded for one host-to-device copy of the shard per gather.
    """
    policies: dict = {}
    reduce_dtype = fsdp_reduce_dtype(cfg)
    if cfg.mixed_precision == "fsdp":
        # cast_forward_inputs off: every block is also handed the rotary table, which must stay fp32 (cast, it
        # would rotate in bf16, and each block would keep its own bf16 copy for backward). The activations need
        # no cast: the bf16 embedding makes the residual stream bf16 from the first block on.
        policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=reduce_dtype or torch.float32,
                                                     cast_forward_inputs=False)
    elif reduce_dtype is not None:
        policies["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    if cfg.offload:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")
    return policies


def apply_dp(model: CausalLM, dp_mesh: DeviceMesh, cfg: Config,
             expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Replicate or shard `model` (or a pipeline chunk) over the dp axis according to `cfg.zero`;
    expert-parallel slices over `expert_mesh` (the "edp" axis) instead, when given."""
    if dp_mesh.size() == 1:
        return model
    if cfg.zero <= 1:
        return apply_ddp(model, dp_mesh, cfg, expert_mesh)
    return apply_fsdp(model, dp_mesh, cfg, expert_mesh)


def build_optimizer(module: nn.Module, dp_mesh: DeviceMesh, cfg: Config) -> torch.optim.Optimizer:
    """The Config's optimizer (`engine/optimizers.py`) over `module`'s parameters; with zero=1 its state is
    sharded over the dp axis.

    With cfg.offload and zero 0/1 it is its `HostOffload` version (state and step on the host); with zero 2/3
    FSDP2's CPUOffloadPolicy already put the shards on the host, so the plain optimizer steps there.
    """
    hyper = hyperparameters(cfg)
    optimizer_class = OPTIMIZERS[cfg.optimizer]
    if cfg.offload and (cfg.zero <= 1 or dp_mesh.size() == 1):
        optimizer_class = HostOffload.of(optimizer_class)
    if cfg.zero == 1 and dp_mesh.size() > 1:
        return zero_redundancy(module.parameters(), optimizer_class, dp_mesh.get_group(), **hyper)
    return optimizer_class(module.parameters(), **hyper)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Hold back the data-parallel all-reduce on all but the last micro-batch of a step.

    FSDP2 (zero 2/3) reduce-scatters after every micro-batch on purpose: skipping it would keep
    a full, unsharded gradient on every rank, which is the memory ZeRO-2/3 exist to save.
    """
    if enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule) and _is_replicate(module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def _is_replicate(module: nn.Module) -> bool:
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

    return isinstance(module, ReplicateModule)
