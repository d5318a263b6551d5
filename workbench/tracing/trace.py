"""Trace a model once, forward and backward, on fake tensors: what each block holds, computes and saves.

Nothing is allocated: the model is built and run under torch's FakeTensorMode, whose tensors carry shapes, dtypes
and a device (the CPU, so the kernels chosen are the CPU's, as the ranks here run them) but no storage. While it
runs:
- FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode`, per module, forward and backward apart (the
  CPU's fused attention kernel, which it has no formula for, is counted as its math: q·kᵀ and p·v);
- the tensors autograd saves for backward are seen by a saved-tensor hook pair, each storage once, parameters
  and the model's buffers left out (what `telemetry.activations.ActivationMeter` counts on the ranks), each
  charged to the block (or the edge of the model) that saved it first;
- each block's linears give its matmuls' shapes, and the tensor-parallel plan says which are split and which
  inputs are saved whole under sequence parallel;
- the per-op recompute policy (engine/parallel/recompute.py: keep every other matmul's output and attention's) is
  followed op by op, so what it would keep and recompute of each block is known without running it;
- a model that follows the protocol (`workbench.models.protocol`; `probes.py`) says how many experts each token is routed to
  (its experts' inputs), and what its attention kernel is handed (one more forward of its blocks, its attention
  routed to a kernel that records q, k and v): context parallel's ring passes those keys and values.
Blocks with equal figures are one kind (`ModelProfile.kinds`).
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from workbench.model_profile import BlockProfile, Gemm, ModelProfile
from workbench.tracing.kernels import FLOP_FORMULAS, GroupedShapes
from workbench.tracing.parts import Parts, is_column, is_split
from workbench.tracing.probes import attention_shapes, expert_hooks

aten = torch.ops.aten
PRECISIONS = ("fp32", "low", "bf16_params")


OP_POLICY_ATTENTION = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                       aten._scaled_dot_product_flash_attention.default,
                       aten._scaled_dot_product_efficient_attention.default,
                       aten._scaled_dot_product_cudnn_attention.default)
"""The attention kernels whose outputs the per-op recompute policy keeps (with every other `aten.mm`), as
engine/parallel/recompute.py's OP_POLICY_SAVES lists them."""


@dataclass(eq=False)
class _Region:
    """What one block (or edge of the model) saved and which of it is gathered, weight copies, split inputs."""

    saved: int = 0
    gathered: int = 0
    copies: int = 0
    gemms: list[Gemm] = field(default_factory=list)
    replicated: int = 0
    """Of `saved`: what its mixture of experts saves (whole on every tp rank), its weight copies aside."""
    whole_copies: int = 0
    """Of `copies`: its mixture of experts' weight copies."""
    matmuls: int = 0
    """`aten.mm` calls of its forward so far (the per-op policy keeps the odd ones, recomputes the even ones)."""
    op_kept: int = 0
    """What the per-op policy would keep of its forward (`BlockProfile.op_kept_bytes`)."""
    op_whole: int = 0
    op_recomputed: float = 0.0
    """Forward FLOPs of the matmuls the per-op policy would run again in backward."""
    op_recomputed_whole: float = 0.0
    experts: int = 0
    """Routed experts, and how many each token goes to, as its experts are called (`probes.expert_hooks`)."""
    top_k: int = 0


def trace(build: Callable[[], nn.Module], *, seq_len: int, precision: str = "fp32", name: str = "",
          plan: dict[str, str] | None = None, vocab_size: int | None = None) -> ModelProfile:
    """The profile of the model `build()` returns, for one sequence of `seq_len` tokens.

    build: makes the model (called under FakeTensorMode: its parameters are fake, nothing is allocated; one it builds
    on the meta device, as the ranks do, is made fake on the CPU).
    precision: "fp32"; "low", bf16 autocast over fp32 parameters (what bf16, fp16 and fp8's bf16 save); or
    "bf16_params", bf16 parameters and no autocast (FSDP2's mixed precision, Config.mixed_precision="fsdp").
    plan: the tensor-parallel plan of one block ({"attention.wq": "colwise", ...}, "*" for any name); None takes
    the model's own (`Parts.plan`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    start = time.perf_counter()
    mode = FakeTensorMode()
    default = torch.get_default_dtype()
    try:
        if precision == "bf16_params":  # built in bf16, and what the model makes at the default dtype with it
            torch.set_default_dtype(torch.bfloat16)
        with mode:
            # A model that builds in its own dtype (transformers' from_config takes fp32) has its parameters
            # cast on the meta device, as FSDP2's mixed precision casts them for compute; its buffers stay.
            params = torch.bfloat16 if precision == "bf16_params" else None
            model = _on_fake_cpu(build(), mode, params)
    finally:
        torch.set_default_dtype(default)
    parts = Parts.of(model)
    plan = parts.plan if plan is None else plan
    vocab = vocab_size or parts.vocab_size
    with mode:  # inputs and targets apart, as a rank's batch reaches the model
        inputs, targets = torch.randint(0, vocab, (1, seq_len)), torch.randint(0, vocab, (1, seq_len))
    regions, first, last = _Watch(model, parts, plan), _Region(), _Region()
    # One counter for forward and backward, so that backward's FLOPs are charged to the modules too.
    with mode, GroupedShapes(), FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        with regions.hooks(first, last), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "low"):
            logits = parts.logits(model(inputs))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        forward = _totals(counter)
        loss.backward()
        both = _totals(counter)
    backward = {k: v - forward.get(k, 0) for k, v in both.items()}
    attention = attention_shapes(model, parts, mode, seq_len)
    return _profile(model, parts, plan, regions, first, last, forward, backward, attention, seq_len, precision, name,
                    time.perf_counter() - start)


class _Casts(TorchDispatchMode):
    """Sees every copy to another dtype, so that autocast's casts of weights and of gathered inputs are known."""

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.watch.current is None and isinstance(out, torch.Tensor):
            self.watch.outside.add(self.watch.hold(out))  # made between the parts: shared by the blocks
        if func is aten._to_copy.default and isinstance(args[0], torch.Tensor):
            source = _key(args[0])
            if source in self.watch.params:
                self.watch.weight_casts.add(self.watch.hold(out))
            elif source in self.watch.gathered:
                self.watch.gathered.add(self.watch.hold(out))
        region = self.watch.current
        if region is not None and any(region is b for b in self.watch.blocks):
            if func is aten.mm.default:
                self._matmul(region, args[0], args[1], out)
            elif func in OP_POLICY_ATTENTION:
                region.op_kept += sum(_nbytes(t) for t in out if isinstance(t, torch.Tensor))
        return out

    def _matmul(self, region: _Region, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """The per-op policy counts a block's matmuls and keeps the odd ones' outputs (the 1st, 3rd, ...):
        sharded by a column-parallel linear, whole otherwise; the even ones run again in backward."""
        region.matmuls += 1
        style = self.watch.linear_style
        if region.matmuls % 2:
            region.op_kept += _nbytes(out)
            region.op_whole += 0 if is_column(style) else _nbytes(out)
        else:
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            region.op_recomputed += flops
            region.op_recomputed_whole += 0 if is_split(style) else flops


def _on_fake_cpu(model: nn.Module, mode: FakeTensorMode, param_dtype: torch.dtype | None = None) -> nn.Module:
    """`model` with every tensor on the meta device (as the ranks build a model before laying it out) made a fake
    CPU tensor: the same shapes, no storage, and the CPU's kernels chosen as the ranks here run them; its
    floating-point parameters in `param_dtype` if given. A tied parameter stays one parameter."""
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            meta = t.detach()
            if param_dtype is not None and isinstance(t, nn.Parameter) and t.is_floating_point():
                meta = meta.to(param_dtype)
            made = FakeTensor(mode, meta, torch.device("cpu"))
            fakes[id(t)] = nn.Parameter(made, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else made
        return fakes[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and t.device.type == "meta":
                    table[name] = fake(t)
    return model


class _Watch:
    """The hooks that charge each saved storage to the block (or edge) saving it."""

    def __init__(self, model: nn.Module, parts: Parts, plan: dict[str, str]) -> None:
        self.model, self.parts, self.plan = model, parts, plan
        self.blocks = [_Region() for _ in parts.blocks]
        self.norm = _Region()
        self.shared = _Region()
        """What the blocks save of the tensors made between the parts (rotary cos/sin, masks)."""
        self.handed: dict[int, int] = {}
        """Storages made between the parts that a block is handed positionally (non-reentrant checkpointing saves a
        block's positional inputs, not its keyword ones), and their bytes."""
        self.replicated = 0
        """How deep the forward is inside mixture-of-experts modules (which run whole on every tp rank)."""
        self.current: _Region | None = None
        self.seen: set[int] = set()
        self.ignored = {_key(t) for t in (*model.parameters(), *model.buffers())}
        self.params = {_key(p) for p in model.parameters()}
        self.gathered: set[int] = set()
        """Storages of the inputs of column-parallel linears, and their casts: saved whole under sequence parallel."""
        self.weight_casts: set[int] = set()
        """Storages of autocast's copies of parameters."""
        self.outside: set[int] = set()
        """Storages made between the parts (outside the embedding and every block): shared, not a block's own."""
        self.linear_style: str | None = None
        """The plan's style of the linear running now (None outside linears, or for one the plan does not name)."""
        self.held: list[torch.Tensor] = []
        """Every tensor whose storage is remembered, kept alive (fake: no memory) so that no other storage is made
        at its address while the trace runs."""

    def hold(self, t: torch.Tensor) -> int:
        self.held.append(t)
        return _key(t)

    def hooks(self, first: _Region, last: _Region):
        import contextlib

        @contextlib.contextmanager
        def installed():
            handles = []
            entering = lambda region: lambda *_: setattr(self, "current", region)  # noqa: E731
            leaving = lambda *_: setattr(self, "current", None)  # noqa: E731
            if self.parts.embedding is not None:
                handles += [self.parts.embedding.register_forward_pre_hook(entering(first)),
                            self.parts.embedding.register_forward_hook(leaving)]
            if self.parts.norm is not None:
                handles += [self.parts.norm.register_forward_pre_hook(entering(self.norm)),
                            self.parts.norm.register_forward_hook(leaving)]
            for (path, block), region in zip(self.parts.blocks, self.blocks, strict=True):
                handles += [block.register_forward_pre_hook(entering(region)), block.register_forward_hook(leaving),
                            block.register_forward_pre_hook(self._handed)]
                handles += self._linear_hooks(block, region)
            handles += expert_hooks(self.model, [path for path, _ in self.parts.blocks], self.blocks)
            for path, block in self.parts.blocks:
                for name in _moe_modules(block):
                    module = block.get_submodule(name)
                    handles += [module.register_forward_pre_hook(lambda *_: self._inside(1)),
                                module.register_forward_hook(lambda *_: self._inside(-1))]
            self.first, self.last = first, last
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), _Casts(self):
                    yield
            finally:
                for h in handles:
                    h.remove()
        return installed()

    def _linear_hooks(self, block: nn.Module, region: _Region) -> list:
        handles = []
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            style = _style(self.plan, name)
            split = ("column" if is_column(style) else "row") if is_split(style) else None
            region.gemms.append(Gemm(n=module.out_features, k=module.in_features, split=split))
            if is_column(style):
                handles.append(module.register_forward_pre_hook(
                    lambda _m, args: self.gathered.add(self.hold(args[0]))))
            handles += [module.register_forward_pre_hook(lambda _m, _a, s=style: setattr(self, "linear_style", s)),
                        module.register_forward_hook(lambda *_: setattr(self, "linear_style", None))]
        return handles

    def _handed(self, _block: nn.Module, args: tuple) -> None:
        for t in args[1:]:  # the first is the hidden states, a block's own input
            if isinstance(t, torch.Tensor) and _key(t) in self.outside:
                self.handed[_key(t)] = t.untyped_storage().nbytes()

    def _inside(self, step: int) -> None:
        self.replicated += step

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key in self.ignored or key in self.seen:
            return t
        self.seen.add(key)
        region = self.current or self.last  # outside every block and the embedding: the model's end
        if key in self.outside and region is not self.last and region is not self.norm:
            region = self.shared  # made once per forward before the blocks (rotary cos/sin, masks), read by them all
        nbytes = t.untyped_storage().nbytes()
        region.saved += nbytes
        if key in self.gathered:
            region.gathered += nbytes
        elif key in self.weight_casts:
            region.copies += nbytes
            region.whole_copies += nbytes if self.replicated else 0
        elif self.replicated:
            region.replicated += nbytes
        return t


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _style(plan: dict[str, str], path: str) -> str | None:
    """The plan's style for the module at `path` inside a block ("*" matches one name), or None."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(path, pattern.replace("*", "[!.]*")):
            return style
    return None


def _profile(model, parts, plan, regions, first, last, f_counts, b_counts, attention, seq_len, precision, name,
             trace_s) -> ModelProfile:
    root = type(model).__name__
    kinds: list[BlockProfile] = []
    order: list[int] = []
    block_f = block_b = 0.0
    for (path, block), region, (attention_flops, kv_width, heads, kv_heads, head_dim) in zip(
            parts.blocks, regions.blocks, attention, strict=True):
        f, b = f_counts.get(f"{root}.{path}", 0), b_counts.get(f"{root}.{path}", 0)
        block_f, block_b = block_f + f, block_b + b
        moe = [f"{root}.{path}.{n}" for n in _moe_modules(block)]
        params = list(block.named_parameters())
        kind = BlockProfile(
            params=sum(p.numel() for _, p in params),
            split_params=sum(p.numel() for n, p in params if is_split(_style(plan, n.rsplit(".", 1)[0]))),
            expert_params=sum(p.numel() for _, p in params if p.dim() == 3),
            tensors=len(params), forward_flops=f, backward_flops=b,
            replicated_flops=sum(f_counts.get(m, 0) + b_counts.get(m, 0) for m in moe),
            replicated_forward_flops=sum(f_counts.get(m, 0) for m in moe),
            saved_bytes=region.saved, gathered_bytes=region.gathered, weight_copies=region.copies,
            replicated_bytes=region.replicated, whole_copies=region.whole_copies,
            gemms=tuple(region.gemms), attention_flops=attention_flops, kv_width=kv_width, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, experts=region.experts,
            top_k=region.top_k, op_kept_bytes=region.op_kept, op_whole_bytes=region.op_whole,
            op_recomputed_flops=region.op_recomputed, op_recomputed_whole_flops=region.op_recomputed_whole,
            shapes=tuple(tuple(p.shape) for _, p in params))
        if kind not in kinds:
            kinds.append(kind)
        order.append(kinds.index(kind))
    total_f, total_b = f_counts.get("Global", 0), b_counts.get("Global", 0)
    emb, head = parts.embedding, parts.head
    tied = emb is not None and head is not None and head.weight is emb.weight
    return ModelProfile(
        name=name or root, seq_len=seq_len, precision=precision, dim=parts.dim, vocab_size=parts.vocab_size,
        kinds=tuple(kinds), blocks=tuple(order),
        embedding_params=sum(p.numel() for p in emb.parameters()) if emb is not None else 0,
        norm_params=sum(p.numel() for p in parts.norm.parameters()) if parts.norm is not None else 0,
        head_params=0 if tied else sum(p.numel() for p in head.parameters()),
        head_split=parts.vocab_parallel, head_forward_flops=total_f - block_f, head_backward_flops=total_b - block_b,
        first_saved=first.saved, shared_saved=regions.shared.saved, shared_handed=sum(regions.handed.values()),
        last_saved=last.saved + regions.norm.saved,
        last_sharded=regions.norm.saved,
        last_copies=last.copies,
        params=sum(p.numel() for p in model.parameters()), trace_s=trace_s)


def _totals(counter: FlopCounterMode) -> dict[str, float]:
    return {module: sum(ops.values()) for module, ops in counter.get_flop_counts().items()}


def _moe_modules(block: nn.Module) -> list[str]:
    """Paths (in the block) of the modules whose child holds stacked experts (3-D parameters): a mixture-of-experts
    FFN, which runs whole on every tensor-parallel rank."""
    out = []
    for name, module in block.named_modules():
        if any(p.dim() == 3 for p in module.parameters(recurse=False)):
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if parent and parent not in out:
                out.append(parent)
    return out
