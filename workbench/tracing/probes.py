"""What a trace asks a model through the protocol (`workbench.models.protocol`), beside what its hooks see: the
shapes its attention hands a kernel (what context parallel's ring passes, and the attention FLOPs the ring hides
behind), and how many experts each token is routed to. A model that is not a protocol model, or whose attention or
experts cannot be reached, answers zeros: the estimator then leaves those figures out."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from workbench.tracing.kernels import GroupedShapes, attention_flops
from workbench.tracing.parts import Parts


def attention_shapes(model: nn.Module, parts: Parts, mode: FakeTensorMode, seq_len: int
                     ) -> list[tuple[float, int, int, int, int]]:
    """Per block: its attention's forward FLOPs for one sequence of `seq_len` tokens, the key and value elements
    per token it hands its kernel, its query heads, key/value heads and head width, as the model hands them to the
    kernel the protocol's `use_attention` installs (what context parallel replaces). One forward of each block
    without autograd, a few tokens long (the widths do not depend on the length); zeros everywhere for a model
    whose attention cannot be reached."""
    from workbench.models.protocol import Unsupported

    seen: list[tuple[torch.Size, torch.Size, torch.Size]] = []

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        seen.append((q.shape, k.shape, v.shape))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    none = [(0.0, 0, 0, 0, 0)] * len(parts.blocks)
    if not hasattr(model, "use_attention") or not hasattr(model, "call_block"):
        return none
    try:
        model.use_attention(kernel)
    except Unsupported:
        return none
    out = []
    dtype = next(model.parameters()).dtype
    with mode, GroupedShapes(), torch.no_grad():
        hidden = torch.zeros(1, min(seq_len, 16), parts.dim, dtype=dtype)
        inputs = model.block_inputs(hidden)
        for _path, block in parts.blocks:
            seen.clear()
            model.call_block(block, hidden, inputs)
            out.append((float(sum(attention_flops((1, q[1], seq_len, q[-1]), (1, k[1], seq_len, k[-1]), v)
                                  for q, k, v in seen)),
                        sum(k[1] * k[-1] + v[1] * v[-1] for _q, k, v in seen),
                        *((seen[0][0][1], seen[0][1][1], seen[0][0][-1]) if seen else (0, 0, 0))))
    return out


def expert_hooks(model: nn.Module, block_paths: list[str], regions: list[Any]) -> list:
    """Hooks by which a protocol model's routed experts in transformers' convention say, as they are called, how
    many experts each token goes to (`top_k_index`'s width): set as `experts` and `top_k` on the region of the
    block (of `block_paths`, one region each) that holds them."""
    from workbench.models.protocol import Unsupported

    try:
        experts = model.routed_experts() if hasattr(model, "routed_experts") else []
    except Unsupported:
        return []
    handles = []
    by_path = dict(zip(block_paths, regions, strict=True))
    for e in experts:
        block_path = next((p for p in by_path if e.path.startswith(p + ".")), None)
        if e.call != "routed" or block_path is None:
            continue

        def routed(_m, args, kwargs, region=by_path[block_path], n=e.n_experts):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            region.experts, region.top_k = n, index.shape[-1]

        handles.append(model.get_submodule(e.path).register_forward_pre_hook(routed, with_kwargs=True))
    return handles
