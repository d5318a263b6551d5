"""Gradient compression (Config.compression) under DDP's comm hooks: what each scheme sends per bucket."""

from __future__ import annotations

import math

from workbench.estimate.collectives import Network, collective
from workbench.estimate.records import Collective, Role
from workbench.estimate.stage import Stage

QUANT_BLOCK = {"int8": 256, "1bit": 2048}
"""Values per scale, as workbench.engine.parallel.quantize uses them (kept here: no torch import)."""


def compressed_sync(st: Stage, net: Network, buckets: list[int], hidden_by: float) -> list[Collective]:
    """DDP's gradient sync under a compression hook (zero 0/1, tp = 1; Config refuses the rest), for DDP's
    gradient buckets of `buckets` bytes each."""
    cfg = st.cfg
    grads, n = sum(buckets), len(buckets)
    over = "dp_cp" if cfg.cp > 1 else "dp"
    if cfg.compression in ("fp16", "bf16"):
        return [collective(net, st.rank, "dp", "all_reduce", Role.GRADIENT_SYNC, f"gradients ({cfg.compression})", n,
                           grads / 2 / n, st.sync, hidden_by=hidden_by, over=over)]
    if cfg.compression == "powersgd":
        sent = sum(powersgd_elements(shape, cfg.powersgd_rank) for shape in parameter_shapes(st))
        return [collective(net, st.rank, "dp", "all_reduce", Role.GRADIENT_SYNC,
                           f"gradients (PowerSGD rank {cfg.powersgd_rank})", 3 * n, 4 * sent / (3 * n), st.sync,
                           hidden_by=hidden_by, over=over)]
    payload = sum(quantized_bucket_bytes(b // 4, st.sync, cfg.compression) for b in buckets)
    # Two phases per bucket, each moving the whole quantised bucket: all_to_all, then all_gather.
    phase = f"gradients ({cfg.compression}, phase"
    return [collective(net, st.rank, "dp", "all_to_all", Role.GRADIENT_SYNC, f"{phase} 1)", n, payload / n, st.sync,
                       hidden_by=hidden_by, over=over),
            collective(net, st.rank, "dp", "all_gather", Role.GRADIENT_SYNC, f"{phase} 2)", n, payload / n, st.sync,
                       hidden_by=hidden_by, over=over)]


def parameter_shapes(st: Stage) -> list[tuple[int, ...]]:
    """Parameter shapes of this stage (tp = 1): what PowerSGD compresses, matrix by matrix (a traced model's as
    traced, its embedding and head vocabulary × width)."""
    if st.profile is not None:
        p = st.profile
        shapes = [shape for i in st.layers for shape in p.block(i).shapes]
        if st.first and p.embedding_params:
            shapes.append((p.embedding_params // p.dim, p.dim))
        if st.last:
            shapes += [(p.norm_params,)] if p.norm_params else []
            shapes += [(p.vocab_size, p.dim)] if p.head_params else []
        return shapes
    m = st.shape
    kv = m.kv_heads * m.head_dim
    block = [(m.dim, m.dim), (kv, m.dim), (kv, m.dim), (m.dim, m.dim), (m.hidden_dim, m.dim),
             (m.dim, m.hidden_dim), (m.hidden_dim, m.dim), (m.dim,), (m.dim,)]
    shapes = block * len(st.layers)
    if st.first:
        shapes.append((m.vocab_size, m.dim))
    if st.last:
        shapes += [(m.dim,), (m.vocab_size, m.dim)]
    return shapes


def quantized_bucket_bytes(values: int, dp: int, scheme: str) -> int:
    """Bytes of one bucket of `values` fp32 gradients quantised whole: padded to dp·block values, 1 byte (int8)
    or 1 bit (1bit) per value plus a 4-byte scale per block."""
    block = QUANT_BLOCK[scheme]
    padded = -(-values // (dp * block)) * dp * block
    return (padded if scheme == "int8" else padded // 8) + 4 * (padded // block)


def powersgd_elements(shape: tuple[int, ...], rank: int) -> int:
    """fp32 values PowerSGD all-reduces for one parameter: P (m·r) and Q (n·r) for a matrix worth compressing
    (torch's min_compression_rate 2: m·n ≥ 2·(m + n)·r), else the whole tensor."""
    if len(shape) == 2:
        rows, cols = shape
        r = min(rank, rows, cols)
        if rows * cols >= 2 * (rows + cols) * r:
            return (rows + cols) * r
    return math.prod(shape)
