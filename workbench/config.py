"""What a run is: one frozen value, validated when it is made.

`Config` holds the model shape, the parallel layout and the training settings.
Every impossible combination is refused on construction with a `ValueError`
that names the field, the values and a fix, so nothing invalid ever reaches a
rank. Variants are made with `dataclasses.replace(cfg, tp=2)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from workbench.engine.parallel.schedule_grid import virtual_stages

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16", "fp16"]
Compression = Literal["none", "fp16", "bf16", "powersgd", "int8", "1bit"]

SCHEDULE_HELP = {
    "gpipe": "GPipe: all forwards, then all backwards; simple, holds every micro-batch's activations",
    "1f1b": "1F1B: one forward, one backward in steady state; same bubble as GPipe, at most pp micro-batches of activations",
    "interleaved_1f1b": "interleaved 1F1B: several smaller stages per rank; the bubble shrinks by that factor",
}
ZERO_HELP = {
    0: "ZeRO 0 = DDP: every rank holds all parameters, gradients and optimizer state; gradients all-reduced",
    1: "ZeRO 1 = DDP + ZeroRedundancyOptimizer: optimizer state sharded across dp ranks",
    2: "ZeRO 2 = FSDP2 without resharding after forward: gradients and optimizer state sharded",
    3: "ZeRO 3 = FSDP2: parameters, gradients and optimizer state sharded; parameters gathered per layer",
}
COMPRESSION_HELP = {
    "none": "no compression: gradients all-reduced (zero 0/1) or reduce-scattered (zero 2/3) in fp32",
    "fp16": "gradients sent in fp16: half the bytes (DDP's fp16_compress_hook; FSDP2's reduce_dtype)",
    "bf16": "gradients sent in bf16: half the bytes, fp32's range (DDP's bf16_compress_hook; FSDP2's reduce_dtype)",
    "powersgd": "PowerSGD (zero 0/1): each gradient matrix sent as a rank-r product, with error feedback",
    "int8": "int8 with a scale per 256 values (zero 0/1): about 1/4 of the bytes, with error feedback",
    "1bit": "signs with a scale per 2048 values (zero 0/1): about 1/32 of the bytes, with error feedback",
}
OFFLOAD_HELP = (
    "ZeRO-Offload: AdamW's moments live in host memory and the optimizer step runs on the host. zero 0/1: a "
    "host AdamW over fp32 master copies, parameters copied back to the device; zero 2/3: FSDP2's "
    "CPUOffloadPolicy, which also keeps the parameter and gradient shards on the host between uses"
)
RECOMPUTE_HELP = {
    "none": "no activation checkpointing: every activation kept for backward",
    "selective": "checkpoint every other transformer block: less memory, some recomputation",
    "full": "checkpoint every transformer block: least activation memory, one extra forward",
}


class ConfigError(ValueError):
    """An impossible configuration; the message names the field and a fix."""


def _refuse(field_name: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{field_name}: {problem}. Fix: {fix}.")


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise _refuse(name, f"{value!r} is not one of {', '.join(map(repr, allowed))}", f"use one of {allowed}")


def _check_positive(**values: int | float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _refuse(name, f"must be a positive number, got {value!r}", f"set {name} > 0")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a decoder-only transformer (RMSNorm, rotary positions, SwiGLU, grouped-query attention)."""

    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; dim must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    vocab_size: int = 256
    """Token vocabulary; 256 is byte-level text, which the workbench's data uses."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP; None means about 8/3·dim rounded up to a multiple of 64."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_experts: int = 0
    """Experts per mixture-of-experts FFN; 0 means a dense model (every FFN one SwiGLU MLP)."""
    top_k: int = 2
    """Experts each token is routed to (top-k of the router's softmax); 1 ≤ top_k ≤ n_experts."""
    capacity_factor: float = 1.25
    """Slots per expert as a multiple of a perfectly even share: ceil(capacity_factor·seq_len·top_k/n_experts)
    per sequence; assignments beyond it are dropped (the token skips that expert)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss added to the training loss (0 turns it off)."""
    moe_every: int = 1
    """Every moe_every-th block's FFN is a mixture of experts (blocks moe_every-1, 2·moe_every-1, ...)."""
    shared_expert: bool = False
    """Add one dense SwiGLU expert that every token goes through, beside the routed ones."""

    def __post_init__(self) -> None:
        _check_positive(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                        vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
        if self.n_kv_heads is not None:
            _check_positive(n_kv_heads=self.n_kv_heads)
        if self.ffn_dim is not None:
            _check_positive(ffn_dim=self.ffn_dim)
        if self.dim % self.n_heads:
            raise _refuse("model.n_heads", f"dim={self.dim} is not divisible by n_heads={self.n_heads}",
                          "choose n_heads dividing dim")
        if (self.dim // self.n_heads) % 2:
            raise _refuse("model.n_heads", f"head dim {self.dim // self.n_heads} is odd; rotary needs it even",
                          "choose n_heads so that dim/n_heads is even")
        if self.n_heads % self.kv_heads:
            raise _refuse("model.n_kv_heads", f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}",
                          "choose n_kv_heads dividing n_heads")
        self._check_experts()

    def _check_experts(self) -> None:
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise _refuse("model.n_experts", f"must be an integer ≥ 0, got {self.n_experts!r}",
                          "set n_experts=0 (dense) or the number of experts")
        if self.n_experts == 0:
            return
        if self.n_experts == 1:
            raise _refuse("model.n_experts", "one expert is a dense FFN with a router in front",
                          "set n_experts ≥ 2, or 0 for a dense model")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            raise _refuse("model.top_k", f"top_k={self.top_k!r} must be an integer in 1..n_experts={self.n_experts}",
                          f"choose top_k between 1 and {self.n_experts}")
        _check_positive(**{"model.capacity_factor": self.capacity_factor})
        if isinstance(self.aux_loss_coef, bool) or not isinstance(self.aux_loss_coef, (int, float)) \
                or self.aux_loss_coef < 0:
            raise _refuse("model.aux_loss_coef", f"must be ≥ 0, got {self.aux_loss_coef!r}",
                          "set aux_loss_coef ≥ 0 (0.01 is the usual weight)")
        if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int) \
                or not 1 <= self.moe_every <= self.n_layers:
            raise _refuse("model.moe_every", f"moe_every={self.moe_every!r} must be an integer in 1..n_layers="
                          f"{self.n_layers}", "choose moe_every so that at least one block is a mixture of experts")

    def same_weights(self, other: "ModelConfig") -> bool:
        """Whether `other` describes the same parameters: equal but for the routing settings (top_k,
        capacity_factor, aux_loss_coef), which change how experts are used, not what they are."""
        routing = {"top_k", "capacity_factor", "aux_loss_coef"}
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self)
                   if f.name not in routing)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s FFN is a mixture of experts."""
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the blocks whose FFN is a mixture of experts."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def expert_capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence (the routing group): ceil(capacity_factor·seq_len·top_k / n_experts)."""
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts) if self.n_experts else 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return -(-(8 * self.dim // 3) // 64) * 64

    @property
    def num_params(self) -> int:
        """Parameter count, from the shapes (embedding and output are not tied)."""
        attn = self.dim * self.dim * 2 + self.dim * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.dim * self.hidden_dim
        block = attn + mlp + 2 * self.dim
        return self.vocab_size * self.dim * 2 + self.n_layers * block + self.dim + self.n_moe_layers * (
            self.moe_params - mlp)

    @property
    def moe_params(self) -> int:
        """Parameters of one mixture-of-experts FFN: router, every expert, the shared expert if any."""
        mlp = 3 * self.dim * self.hidden_dim
        return self.dim * self.n_experts + self.n_experts * mlp + (mlp if self.shared_expert else 0)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: a MoE FFN counts its router, top_k experts and the shared expert."""
        mlp = 3 * self.dim * self.hidden_dim
        active_moe = self.dim * self.n_experts + self.top_k * mlp + (mlp if self.shared_expert else 0)
        return self.num_params - self.n_moe_layers * (self.moe_params - active_moe)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named shape: "tiny" trains visibly in a minute on 2 CPU cores; the others are real sizes."""
        try:
            return PRESETS[name]
        except KeyError:
            raise _refuse("model", f"unknown preset {name!r}", f"use one of {sorted(PRESETS)}") from None


PRESETS: dict[str, ModelConfig] = {
    # byte-level, ~0.9 M parameters: a few steps per second on two CPU cores
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024),
    # tiny with a mixture of 4 SwiGLU experts (top-2) in every block: ~2.6 M parameters, ~1.4 M active per token
    "tiny-moe": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024, n_experts=4, top_k=2),
    # byte-level, ~10 M parameters: CPU experiments that need visible memory
    "small": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, max_seq_len=2048),
    # GPT-3 small shape with GPT-2's padded vocabulary
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, vocab_size=50304, ffn_dim=2048, max_seq_len=2048),
    # Llama-3.2-1B shape
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                      max_seq_len=8192, rope_theta=500000.0),
    # Llama-3-8B shape
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything a run is: model shape, parallel layout, precision and training settings."""

    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    """The model's shape; `ModelConfig.preset("tiny")` and friends."""
    dp: int = 1
    """Data-parallel degree: replicas (or ZeRO shards) that each see their own slice of the batch."""
    tp: int = 1
    """Tensor-parallel degree: each weight matrix split across this many ranks (Megatron column/row)."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into this many consecutive stages."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split across this many of the dp ranks (ep divides dp);
    tokens travel to their experts by all-to-all. The world stays dp·tp·pp."""
    zero: int = 0
    """ZeRO stage 0-3 across the dp ranks (0 DDP, 1 +sharded optimizer, 2 FSDP2 no reshard, 3 FSDP2)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule when pp > 1: "gpipe", "1f1b" or "interleaved_1f1b"."""
    micro_batches: int = 1
    """Micro-batches per step: pipeline micro-batches when pp > 1, else gradient accumulation steps."""
    stages_per_rank: int = 2
    """Model chunks per pipeline rank for "interleaved_1f1b" (ignored by other schedules)."""
    activation_checkpointing: Recompute = "none"
    """Recompute activations in backward: "none", "selective" (every other block) or "full"."""
    precision: Precision = "fp32"
    """"fp32", "bf16" (autocast) or "fp16" (autocast + dynamic loss scaling)."""
    batch_size: int = 16
    """Sequences per optimizer step, across all data-parallel ranks (the global batch)."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seeds the model's initial weights and the order of the data."""
    compression: Compression = "none"
    """Compression of the data-parallel gradient sync (needs dp > 1): "none", "fp16", "bf16" (any zero stage),
    "powersgd", "int8", "1bit" (zero 0/1: DDP comm hooks; int8/1bit with error feedback). See COMPRESSION_HELP."""
    powersgd_rank: int = 2
    """Rank r of PowerSGD's low-rank factors (compression="powersgd"): an m x n gradient sends (m + n)·r values."""
    offload: bool = False
    """ZeRO-Offload: optimizer state (AdamW moments, fp32 master weights) and the optimizer step on the host
    (CPU memory), parameters copied back to the device after each step. See OFFLOAD_HELP."""

    def __post_init__(self) -> None:
        m = self.model
        if not isinstance(m, ModelConfig):
            raise _refuse("model", f"expected a ModelConfig, got {type(m).__name__}",
                          'pass model=wb.ModelConfig.preset("tiny") or a ModelConfig(...)')
        _check_positive(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, micro_batches=self.micro_batches,
                        stages_per_rank=self.stages_per_rank, batch_size=self.batch_size,
                        seq_len=self.seq_len, lr=self.lr)
        for name in ("dp", "tp", "pp", "ep", "micro_batches", "stages_per_rank", "batch_size", "seq_len", "seed"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise _refuse(name, f"must be an integer, got {getattr(self, name)!r}", f"pass an int for {name}")
        _check_choice("zero", self.zero, (0, 1, 2, 3))
        _check_choice("schedule", self.schedule, get_args(Schedule))
        _check_choice("activation_checkpointing", self.activation_checkpointing, get_args(Recompute))
        _check_choice("precision", self.precision, get_args(Precision))
        _check_choice("compression", self.compression, get_args(Compression))
        _check_positive(powersgd_rank=self.powersgd_rank)
        if not isinstance(self.offload, bool):
            raise _refuse("offload", f"must be True or False, got {self.offload!r}", "pass offload=True or False")
        if self.weight_decay < 0:
            raise _refuse("weight_decay", f"must be ≥ 0, got {self.weight_decay}", "set weight_decay ≥ 0")

        if m.n_heads % self.tp:
            raise _refuse("tp", f"tp={self.tp} does not divide model.n_heads={m.n_heads}",
                          f"choose tp among {divisors(m.n_heads)}")
        if m.kv_heads % self.tp:
            raise _refuse("tp", f"tp={self.tp} does not divide the key/value heads ({m.kv_heads})",
                          f"choose tp among {divisors(m.kv_heads)}")
        if m.hidden_dim % self.tp:
            raise _refuse("tp", f"tp={self.tp} does not divide the MLP width ({m.hidden_dim})",
                          "choose a tp dividing model.hidden_dim")
        if self.tp > 1 and self.seq_len % self.tp:
            raise _refuse("seq_len", f"sequence parallel splits seq_len={self.seq_len} across tp={self.tp}",
                          f"make seq_len a multiple of {self.tp}")
        chunks = self.pp * virtual_stages(self.schedule, self.pp, self.stages_per_rank)
        if m.n_layers % chunks:
            what = f"pp={self.pp}" if chunks == self.pp else f"pp·stages_per_rank={chunks}"
            raise _refuse("pp", f"{what} does not divide model.n_layers={m.n_layers}",
                          f"choose pp (times stages_per_rank for interleaved) among {divisors(m.n_layers)}")
        if self.pp > 1 and self.schedule in ("1f1b", "interleaved_1f1b") and self.micro_batches < self.pp:
            raise _refuse("micro_batches", f"{self.schedule} needs at least pp={self.pp} micro-batches, got "
                          f"{self.micro_batches}", f"set micro_batches ≥ {self.pp}")
        if self.pp > 1 and self.schedule == "interleaved_1f1b" and self.micro_batches % self.pp:
            raise _refuse("micro_batches", f"interleaved 1F1B needs micro_batches ({self.micro_batches}) to be a "
                          f"multiple of pp={self.pp}", f"set micro_batches to a multiple of {self.pp}")
        if self.batch_size % (self.dp * self.micro_batches):
            raise _refuse("batch_size", f"batch_size={self.batch_size} is not divisible by "
                          f"dp·micro_batches={self.dp}·{self.micro_batches}",
                          f"use a multiple of {self.dp * self.micro_batches}")
        if self.seq_len > m.max_seq_len:
            raise _refuse("seq_len", f"seq_len={self.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
                          f"use seq_len ≤ {m.max_seq_len}")
        if self.zero > 0 and self.dp == 1:
            raise _refuse("zero", f"ZeRO stage {self.zero} shards across data-parallel ranks, but dp=1",
                          "set dp ≥ 2 or zero=0")
        if self.zero == 1 and self.dp > 1 and self.tp > 1:
            # torch 2.13: ZeroRedundancyOptimizer broadcasts each updated parameter with c10d.broadcast,
            # which has no DTensor sharding rule, so its step fails on tensor-parallel parameters.
            raise _refuse("zero", f"zero=1 (ZeroRedundancyOptimizer) cannot update tensor-parallel (DTensor) "
                          f"parameters (dp={self.dp}, tp={self.tp})",
                          "use zero=2 (FSDP2: optimizer state and gradients sharded), zero=0, or tp=1")
        self._check_experts()

    def _check_experts(self) -> None:
        m = self.model
        if self.ep > 1 and m.n_experts == 0:
            raise _refuse("ep", f"ep={self.ep} splits experts, but the model is dense (model.n_experts=0)",
                          'set ep=1, or use a mixture-of-experts model (e.g. ModelConfig.preset("tiny-moe"))')
        if m.n_experts and m.n_experts % self.ep:
            raise _refuse("ep", f"ep={self.ep} does not divide model.n_experts={m.n_experts}",
                          f"choose ep among {[d for d in divisors(m.n_experts) if self.dp % d == 0]}")
        if self.dp % self.ep:
            raise _refuse("ep", f"experts are split across data-parallel ranks, and ep={self.ep} does not divide "
                          f"dp={self.dp}", f"set dp to a multiple of {self.ep} (the world stays dp·tp·pp), "
                          f"or ep among {divisors(self.dp)}")
        if self.ep > 1 and self.zero == 1:
            # ZeroRedundancyOptimizer partitions parameters over all dp ranks and broadcasts each update from
            # its owner: expert slices differ across the ep ranks, so a broadcast would overwrite them.
            raise _refuse("zero", f"zero=1 (ZeroRedundancyOptimizer over dp) cannot hold expert slices that "
                          f"differ across ep={self.ep} ranks", "use zero=0, 2 or 3 with ep > 1, or ep=1")

        self._check_compression_and_offload()

    def _check_compression_and_offload(self) -> None:
        kind = self.compression
        if kind != "none" and self.dp == 1:
            raise _refuse("compression", f"{kind!r} compresses the data-parallel gradient sync, but dp=1 has none",
                          'set dp ≥ 2 or compression="none"')
        if kind != "none" and self.tp > 1 and self.zero == 0:
            # With tp > 1, zero=0 is torch's FSDP2-based `replicate`, which takes no DDP comm hook.
            raise _refuse("compression", f"{kind!r} with tp={self.tp} and zero=0: data parallel over tensor-parallel "
                          "(DTensor) parameters uses torch's replicate(), which has no communication hook",
                          'use zero=2 with compression "fp16" or "bf16", or tp=1')
        if kind in ("powersgd", "int8", "1bit") and self.zero >= 2:
            raise _refuse("compression", f"{kind!r} needs DDP's comm hooks (zero 0/1); zero={self.zero} is FSDP2, "
                          "which reduce-scatters gradient shards and has no hook for a custom reduction in torch 2.13",
                          'use zero=0 or 1 for that compression, or "fp16"/"bf16" (FSDP2\'s reduce_dtype) with zero 2/3')
        if self.offload and self.tp > 1:
            raise _refuse("offload", f"offload with tp={self.tp} is not implemented here (the host optimizer of "
                          "zero 0/1 holds plain tensors, not tensor-parallel DTensors)", "set tp=1 or offload=False")

    @property
    def world_size(self) -> int:
        """Ranks this layout needs: dp·tp·pp."""
        return self.dp * self.tp * self.pp

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one micro-batch on one data-parallel rank."""
        return self.batch_size // (self.dp * self.micro_batches)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def layout(self) -> str:
        """A short name for the layout, e.g. "dp2·tp2·zero1·bf16"."""
        parts = [f"{a}{n}" for a, n in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if n > 1] or ["single"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.pp > 1:
            parts.append(f"{self.schedule}×{self.micro_batches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac:{self.activation_checkpointing}")
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.compression != "none":
            parts.append(f"{self.compression}-sync" if self.compression != "powersgd"
                         else f"powersgd{self.powersgd_rank}")
        if self.offload:
            parts.append("offload")
        return "·".join(parts)

    def check_world(self, world_size: int) -> None:
        """Refuse a layout that does not fill a pool of `world_size` ranks."""
        if self.world_size != world_size:
            raise _refuse("dp·tp·pp", f"dp·tp·pp = {self.dp}·{self.tp}·{self.pp} = {self.world_size}, but the pool "
                          f"has {world_size} ranks", f"choose degrees whose product is {world_size} "
                          "(changing the number of ranks needs a new Workbench(world_size=...))")

    def check_device(self, device: str, *, fp16: bool = True, bf16: bool = True) -> None:
        """Refuse a precision the ranks' device cannot run."""
        if self.precision == "fp16" and not fp16:
            raise _refuse("precision", f"fp16 is not supported on {device}", 'use precision="bf16" or "fp32"')
        if self.precision == "bf16" and not bf16:
            raise _refuse("precision", f"bf16 is not supported on {device}", 'use precision="fp16" or "fp32"')

    def replace(self, **changes) -> "Config":
        """`dataclasses.replace`, validated."""
        return dataclasses.replace(self, **changes)

    # -- as data: config.json for runs outside the notebook --------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON data (the model nested); `Config.from_dict` makes an equal Config of it."""
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """The Config `data` describes (as `to_dict` writes it), validated; an unknown key is refused by name.

        Missing keys take their defaults, so a config.json written before a field existed still loads.
        """
        return _from_dict(cls, data, "")

    def save(self, path: str | Path) -> Path:
        """Write this Config as JSON to `path`."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        """The Config in the JSON file `path` (as `save` or `bench.export` write it)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"config: cannot read {path} ({e}). Fix: pass a config.json written by "
                              "bench.export() or Config.save()") from None
        return cls.from_dict(data)


def _to_dict(value: Any) -> Any:
    """Generic over dataclass fields, so a field added to Config or ModelConfig is written with no change here."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_dict(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_dict(v) for k, v in value.items()}
    return value


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from `data`, recursing into fields whose declared type is a dataclass."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise _refuse(where, f"expected a JSON object, got {type(data).__name__}", "pass a dict as to_dict() writes it")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise _refuse(f"{prefix}{unknown[0]}", f"unknown field(s) {unknown} for {cls.__name__}",
                      f"use the fields {sorted(names)}")
    values = {}
    for name, value in data.items():
        hint = hints.get(name)
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = _from_dict(hint, value, f"{prefix}{name}.")
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)  # JSON has no tuples
        values[name] = value
    return cls(**values)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending: the degrees that split n evenly (offered in errors and in the controls)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def checkpointed_blocks(block_indices: list[int], mode: Recompute) -> list[int]:
    """Which of the given global block indices recompute their activations under `mode`.

    The one rule, used by the engine (which blocks it wraps) and the estimator (what they keep).
    """
    if mode == "full":
        return list(block_indices)
    if mode == "selective":
        # By global index, so a pipeline split recomputes the same blocks as the whole model.
        return [i for i in block_indices if i % 2 == 0]
    return []
