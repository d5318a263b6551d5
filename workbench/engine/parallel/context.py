"""Context parallel: every sequence split over the "cp" ranks, attention over the whole of it by a ring of K/V.

Causal load balancing. The sequence is cut into 2·cp chunks of c tokens and
cp rank r holds chunks r and 2·cp−1−r (Megatron-Core's and torchtitan's
head-tail split): under a causal mask a late chunk attends to much more than
an early one, and pairing them gives every rank the same work.
`balanced_positions` says which tokens a rank holds; the trainer hands each
rank those columns of its batch (`shard_sequence`), and `apply_cp` gives the
model a rotary table of exactly those positions.

Ring exchange (Liu et al. 2023, "Ring Attention"). In cp steps, rank r holds
the keys and values of rank r−i at step i: it attends its queries to them
while passing them on to rank r+1 and receiving the next ones from r−1 (one
send and one recv on the cp group, started before the step's computation so
that the two can overlap). The partial results are merged by their
log-sum-exp, the online softmax of flash attention (Milakov & Gimelshein
2018), so the output equals attention over the whole sequence. With the
balanced chunks each step after the first is half a block: keys of an earlier
rank (r−i < r) serve all of rank r's queries but only their own first chunk;
those of a later rank serve only rank r's second chunk.

Backward sends the keys and values round the ring once more, and the
gradient of each rank's keys and values travels with them, collecting every
rank's contribution, and arrives home after its cp-th hop. What backward
needs is what flash attention saves: q, k, v, the output and the
log-sum-exp, so the activations of a cp rank are those of its seq/cp tokens.

Why our own ring and not torch's `context_parallel`: in torch 2.13 that
dispatches scaled_dot_product_attention through DTensor, and the CPU kernel
(aten._scaled_dot_product_flash_attention_for_cpu) has no sharding strategy,
so it fails on gloo/CPU (FACTS.md). On CUDA its flash/efficient/cuDNN ring
handlers exist, but it patches F.scaled_dot_product_attention for the whole
process inside a context manager and resizes the buffers it is given in
place, which is not a layout a notebook can apply and reshard. One ring on
every device keeps the laptop and the GPU on the same numerics, and its
sends go through the recording backend like every other collective, so the
timeline shows the K/V exchange as send/recv on the "mesh_cp" group (`ring_group`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import Config
from workbench.models.protocol import AttentionKernel, CausalLM
from workbench.models.transformer import CausalAttention

_KV_TAG, _GRAD_TAG = 0, 1
"""Tags of the two exchanges that can be in flight at once in backward (keys/values, their gradients): gloo
matches a recv to a send by peer and tag, so they never cross."""


def balanced_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The positions cp rank `cp_rank` holds: chunks cp_rank and 2·cp−1−cp_rank of 2·cp equal chunks, in order."""
    c = seq_len // (2 * cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def shard_sequence(tokens: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """This cp rank's columns of `tokens` (batch, seq): its two balanced chunks."""
    if cp_mesh.size() == 1:
        return tokens
    index = balanced_positions(tokens.shape[1], cp_mesh.size(), cp_mesh.get_local_rank()).to(tokens.device)
    return tokens.index_select(1, index)


@dataclass
class _Ring:
    """This rank's place on the cp ring: its group, index, size and the neighbours it sends to and receives from."""

    group: dist.ProcessGroup
    rank: int
    size: int
    next: int = field(init=False)
    prev: int = field(init=False)

    def __post_init__(self) -> None:
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def shift(self, tensor: torch.Tensor, tag: int) -> _InFlight:
        """Send `tensor` to the next rank and receive the previous rank's in its place, without waiting."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=self.next, tag=tag),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=self.prev, tag=tag),
        ])
        return _InFlight(works, tensor, received)


@dataclass
class _InFlight:
    works: list
    sent: torch.Tensor
    """Held until the send completes: the backend reads it asynchronously."""
    received: torch.Tensor

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


# -- one block: attention of some queries to some keys, with its log-sum-exp ------------------------------------
# Shapes: q, out, dout (b, heads, sq, d); k, v (b, kv_heads, sk, d); lse (b, heads, sq) fp32. `causal` only where
# sq = sk (a rank's own chunks). Backward takes the whole softmax's out and lse: flash attention's backward then
# gives each block's exact share of the gradients.

def _flash_cpu_forward(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_cpu_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) → (b, kv_heads, heads/kv_heads, s, d) in fp32: the query heads that share a key head."""
    return t.float().unflatten(1, (kv_heads, -1))


def _probabilities(q, k, lse, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)), lse


def _plain_forward(q, k, v, causal: bool, scale: float):
    kv_heads = k.shape[1]
    p, lse = _probabilities(_grouped(q, kv_heads), k.float().unsqueeze(2), None, causal, scale)
    return torch.matmul(p, v.float().unsqueeze(2)).flatten(1, 2), lse.flatten(1, 2)


def _plain_backward(q, k, v, dout, out, lse, causal: bool, scale: float):
    kv_heads = k.shape[1]
    qg, dg, kb, vb = _grouped(q, kv_heads), _grouped(dout, kv_heads), k.float().unsqueeze(2), v.float().unsqueeze(2)
    p, _ = _probabilities(qg, kb, lse.unflatten(1, (kv_heads, -1)), causal, scale)
    delta = (dg * _grouped(out, kv_heads)).sum(dim=-1, keepdim=True)
    ds = p * (torch.matmul(dg, vb.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kb) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * scale
    dv = torch.matmul(p.transpose(-1, -2), dg).sum(dim=2)
    return dq.flatten(1, 2), dk, dv


def _kernels(device: torch.device):
    """The block kernels for `device`: torch's CPU flash-attention op (about 4x faster than the matmuls here, and it
    never holds a block's scores), else the same arithmetic in plain matmuls (what runs on CUDA: untested there)."""
    if device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return _flash_cpu_forward, _flash_cpu_backward
    return _plain_forward, _plain_backward


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one block's (part, part_lse) into the running output of query rows `rows`, in place (online softmax)."""
    total = torch.logaddexp(lse[..., rows], part_lse)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows] - total).unsqueeze(-1)
                         + part.float() * torch.exp(part_lse - total).unsqueeze(-1))
    lse[..., rows] = total


def _blocks(ring: _Ring, step: int, c: int) -> tuple[slice, slice, bool]:
    """At ring step `step`: which query rows attend to which rows of the keys held, and whether causally."""
    src = (ring.rank - step) % ring.size
    if src == ring.rank:
        return slice(None), slice(None), True  # own chunks: causal over the local sequence, as placed
    if src < ring.rank:
        return slice(None), slice(0, c), False  # an earlier rank's first chunk precedes both of ours
    return slice(c, None), slice(None), False  # a later rank's chunks both precede our second one only


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring,
                scale: float | None = None) -> torch.Tensor:
        b, heads, s, d = q.shape
        c, scale = s // 2, scale if scale is not None else 1.0 / math.sqrt(d)
        attend, _ = _kernels(q.device)
        with torch.autocast(q.device.type, enabled=False):
            out = q.new_zeros(q.shape, dtype=torch.float32)
            lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
            kv = torch.stack([k, v])  # sent in the dtype computed in: bf16 under autocast
            for step in range(ring.size):
                pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
                rows, cols, causal = _blocks(ring, step, c)
                part, part_lse = attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale)
                _merge(out, lse, rows, part, part_lse)
                if pending is not None:
                    kv = pending.wait()
            # Laid out (b, s, heads, d) as flash attention's output is, so that the caller's transpose back
            # and reshape to (b, s, heads·d) is a view and wo saves this very tensor.
            result = out.transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
        ctx.ring, ctx.scale = ring, scale
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        c, scale = q.shape[2] // 2, ctx.scale
        _, attend_backward = _kernels(q.device)
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype)
            dq = torch.zeros_like(q, dtype=torch.float32)
            kv = torch.stack([k, v])
            incoming = None  # the gradient of the keys and values now held, summed by the ranks before this one
            for step in range(ring.size):
                pending = ring.shift(kv, _KV_TAG) if step + 1 < ring.size else None
                rows, cols, causal = _blocks(ring, step, c)
                dq_part, dk, dv = attend_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                  dout[:, :, rows], out[:, :, rows], lse[..., rows], causal, scale)
                dq[:, :, rows] += dq_part
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                dkv[0][:, :, cols] = dk
                dkv[1][:, :, cols] = dv
                if incoming is not None:
                    dkv += incoming.wait()
                # On to the next rank, which holds these keys next; after the last step, this reaches their owner.
                incoming = ring.shift(dkv, _GRAD_TAG)
                if pending is not None:
                    kv = pending.wait()
            dkv = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


_WORLD_RING: list[dist.ProcessGroup] = []
"""The ring's own group when cp spans the whole world, made once per process (groups are never destroyed)."""


def ring_group(cp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group the K/V ring runs on: the mesh's cp group, named "mesh_cp" in the timeline. A mesh dim spanning the
    whole world reuses the world group instead (named "default_pg", as the step's vote), so then the ring gets a
    group of its own with DeviceMesh's name for it; it is created collectively, once, and reused by every layout."""
    group = cp_mesh.get_group()
    if group.group_name != dist.group.WORLD.group_name:
        return group
    if not _WORLD_RING:
        _WORLD_RING.append(dist.new_group(ranks=list(range(dist.get_world_size())), group_desc="mesh_cp"))
    return _WORLD_RING[0]


class RingAttention(CausalAttention):
    """Causal attention over the whole sequence, of which this rank holds two balanced chunks (see the module
    docstring): keys and values go round the cp ring. Same interface as `CausalAttention`, no parameters."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.ring = _Ring(ring_group(cp_mesh), cp_mesh.get_local_rank(), cp_mesh.size())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.ring)


def ring_kernel(cp_mesh: DeviceMesh) -> AttentionKernel:
    """Causal attention over the whole sequence by the K/V ring, as the model protocol's attention kernel."""
    ring = _Ring(ring_group(cp_mesh), cp_mesh.get_local_rank(), cp_mesh.size())

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, ring, scale)

    return kernel


def apply_cp(model: CausalLM, mesh: DeviceMesh, cfg: Config) -> CausalLM:
    """Make `model` (or a pipeline chunk) run on this cp rank's share of each sequence, in place: every attention
    goes through the ring exchange (the model protocol's `use_attention`), and the model is given the positions of
    the tokens this rank holds (its rotary table or cos/sin follow them)."""
    if cfg.cp == 1:
        return model
    cp_mesh = mesh["cp"]
    model.use_attention(ring_kernel(cp_mesh))
    model.set_positions(balanced_positions(cfg.seq_len, cfg.cp, cp_mesh.get_local_rank()))
    return model
