"""`Config`: everything a run is, as one frozen, flat, keyword-only value, validated when it is made.

Construction checks every field's type and range (`refusals.py`), then the
rules across fields (`rules.py`, the degrees' own checks among them), so
nothing invalid ever reaches a rank. Variants are `cfg.replace(tp=2)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from workbench.config import rules, serialize
from workbench.config.choices import FP8, ZERO_STAGES, CompileBackend, Compression, ExpertExchange, MixedPrecision
from workbench.config.choices import Optimizer
from workbench.config.choices import Precision, Recompute, Schedule
from workbench.config.degrees import Degrees
from workbench.config.model import PRESETS, ModelConfig
from workbench.config.refusals import at_least, between, check_fields, one_of, positive, refuse
from workbench.config.tokenizer import check_tokenizer

_RANGES = {
    **{name: at_least(1) for name in ("dp", "tp", "pp", "ep", "cp", "dp_replicate", "micro_batches", "stages_per_rank",
                                      "batch_size", "seq_len", "powersgd_rank")},
    "zero": one_of(*ZERO_STAGES),
    "lr": positive,
    "weight_decay": at_least(0),
    "replica_check_every": at_least(0),
    # torch.manual_seed takes a signed or unsigned 64-bit value; the data's generator folds it mod 2**64.
    "seed": between(-2**63, 2**64 - 1, "torch.manual_seed takes 64 bits"),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything a run is: model shape, parallel layout, precision and training settings."""

    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    """The model's shape; `ModelConfig.preset("tiny")` and friends."""
    tokenizer: str | None = None
    """A local tokenizer: a `tokenizers` tokenizer.json, or a Hugging Face tokenizer folder holding one (stored as
    its absolute path); None: bytes, every byte a token (vocabulary 256). Its vocabulary must fit model.vocab_size."""
    dp: int = 1
    """Data-parallel degree: replicas (or ZeRO shards) that each see their own slice of the batch."""
    tp: int = 1
    """Tensor-parallel degree: each weight matrix split across this many ranks (Megatron column/row)."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into this many consecutive stages."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split across this many of the dp ranks (ep divides dp);
    tokens travel to their experts by all-to-all. The world stays dp·tp·pp."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (causally balanced chunks), attention over
    the whole of it by a ring exchange of keys and values. The world is dp·cp·tp·pp; cp ranks average their
    gradients with the dp ranks."""
    expert_exchange: ExpertExchange = "flat"
    """How expert-parallel tokens travel (ep > 1): "flat", one all-to-all over the ep ranks, or "hierarchical",
    first among the ranks of each node, then one message per remote node's peer (Switch/GShard-style two-level
    exchange). Same tokens, same order: the losses are identical. Nodes are the emulated cluster's, else hosts."""
    zero: int = 0
    """ZeRO stage 0-3 across the dp ranks (0 DDP, 1 +sharded optimizer, 2 FSDP2 no reshard, 3 FSDP2)."""
    dp_replicate: int = 1
    """HSDP (zero 2/3): the dp ranks form dp_replicate groups of dp/dp_replicate; FSDP2 shards within a group and
    replicates across groups (a 2-D (dp_replicate, dp_shard) mesh). 1: shard over all dp ranks."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule when pp > 1: "gpipe", "1f1b", "interleaved_1f1b", or with split backwards (input- and
    weight-gradient halves) "interleaved_zb" (ZB1P), "zbv" (ZB-V) or "dualpipev" (DualPipeV); see SCHEDULE_HELP."""
    micro_batches: int = 1
    """Micro-batches per step: pipeline micro-batches when pp > 1, else gradient accumulation steps."""
    stages_per_rank: int = 2
    """Model chunks per pipeline rank for "interleaved_1f1b" and "interleaved_zb" (ignored by the others; "zbv"
    and "dualpipev" always hold 2, in V placement)."""
    activation_checkpointing: Recompute = "none"
    """Recompute activations in backward: "none", "selective" (every other block), "full", or "op" (per op in
    every block: torchtitan's selective op policy, every other matmul output and the attention output kept)."""
    precision: Precision = "fp32"
    """"fp32", "bf16" (autocast), "fp16" (autocast + dynamic loss scaling), or "fp8_tensorwise" / "fp8_rowwise"
    (torchao Float8 linears, bf16 elsewhere; a GPU with fp8, sm_89 or newer). See PRECISION_HELP."""
    mixed_precision: MixedPrecision = "autocast"
    """How bf16 (and fp8's bf16 beside the Float8 linears) runs under ZeRO 2/3: "autocast" (fp32 parameters, cast
    per use) or "fsdp" (FSDP2's MixedPrecisionPolicy, as torchtitan: bf16 parameters gathered for compute, fp32
    shards and optimizer, gradients reduced in fp32 or the compression's dtype). See MIXED_PRECISION_HELP."""
    batch_size: int = 16
    """Sequences per optimizer step, across all data-parallel ranks (the global batch)."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """The optimizer's learning rate, > 0 and finite (for Lion about 3-10× smaller than AdamW's)."""
    weight_decay: float = 0.0
    """The optimizer's weight decay, ≥ 0 (decoupled, as AdamW's, for AdamW and Lion)."""
    optimizer: Optimizer = "adamw"
    """"adamw" (two moments), "lion" (one moment, sign update) or "sgd" (momentum 0.9). See OPTIMIZER_HELP."""
    seed: int = 0
    """Seeds the model's initial weights and the order of the data (64 bits)."""
    replica_check_every: int = 0
    """Every this many steps the data-parallel replicas compare a digest of their parameters (Megatron's check for
    silent corruption); a difference stops training naming the rank and the first differing parameter. 0: off."""
    compression: Compression = "none"
    """Compression of the data-parallel gradient sync (needs dp > 1): "none", "fp16", "bf16" (any zero stage),
    "powersgd", "int8", "1bit" (zero 0/1: DDP comm hooks; int8/1bit with error feedback). See COMPRESSION_HELP."""
    powersgd_rank: int = 2
    """Rank r of PowerSGD's low-rank factors (compression="powersgd"): an m x n gradient sends (m + n)·r values."""
    offload: bool = False
    """ZeRO-Offload: optimizer state (AdamW moments, fp32 master weights) and the optimizer step on the host
    (CPU memory), parameters copied back to the device after each step. See OFFLOAD_HELP."""
    compile: bool = False
    """torch.compile each transformer block (inductor); the first step of a new layout compiles. See COMPILE_HELP."""
    compile_backend: CompileBackend = "inductor"
    """What compile generates code with: "inductor" (fused C++/Triton kernels) or "aot_eager" (the same captured
    forward and backward graphs run by eager kernels: checks the capture in seconds, no code generation)."""
    cuda_graphs: bool = False
    """CUDA Graphs: replay each compiled block's kernels (torch.compile mode="reduce-overhead"); needs compile and a
    CUDA device, not with zero 2/3, offload, pp or experts. See CUDA_GRAPHS_HELP."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise refuse("model", f"expected a ModelConfig, got {type(self.model).__name__}",
                         'pass model=wb.ModelConfig.preset("tiny") or a ModelConfig(...)')
        if isinstance(self.tokenizer, PurePath):
            object.__setattr__(self, "tokenizer", str(self.tokenizer))  # JSON has no paths
        check_fields(self, _RANGES)
        object.__setattr__(self, "tokenizer", check_tokenizer(self.tokenizer))
        rules.check(self)

    # -- derived ------------------------------------------------------------------------------------------
    @property
    def degrees(self) -> Degrees:
        """The parallel degrees as one value (what builds the mesh). ZeRO 0/1 keep whole parameters on every dp
        rank (dp_replicate = dp); ZeRO 2/3 are FSDP2, which shards them (dp_shard = dp)."""
        if self.zero >= 2:
            replicate, shard = self.dp_replicate, self.dp // self.dp_replicate
        else:
            replicate, shard = self.dp, 1
        return Degrees(pp=self.pp, tp=self.tp, ep=self.ep, cp=self.cp, dp_replicate=replicate, dp_shard=shard)

    @property
    def world_size(self) -> int:
        """Ranks this layout needs: dp·cp·tp·pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def hsdp(self) -> bool:
        """FSDP2 replicated across dp_replicate groups and sharded within each (zero 2/3, 1 < dp_replicate < dp)."""
        return self.zero >= 2 and 1 < self.dp_replicate < self.dp

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
        parts = [f"{a}{n}" for a, n in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))
                 if n > 1] or ["single"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + ("h" if self.expert_exchange == "hierarchical" else ""))
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.hsdp:
            parts.append(f"hsdp{self.dp_replicate}×{self.dp // self.dp_replicate}")
        if self.pp > 1:
            parts.append(f"{self.schedule}×{self.micro_batches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac:{self.activation_checkpointing}")
        if self.precision != "fp32":
            parts.append(self.precision + ("-fsdp" if self.mixed_precision == "fsdp" else ""))
        if self.compression != "none":
            parts.append(f"{self.compression}-sync" if self.compression != "powersgd"
                         else f"powersgd{self.powersgd_rank}")
        if self.offload:
            parts.append("offload")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.compile:
            backend = "" if self.compile_backend == "inductor" else f"({self.compile_backend})"
            parts.append("compiled" + backend + ("+graphs" if self.cuda_graphs else ""))
        return "·".join(parts)

    # -- checks against where it runs ---------------------------------------------------------------------
    def check_world(self, world_size: int) -> None:
        """Refuse a layout that does not fill a pool of `world_size` ranks."""
        self.degrees.check_world(world_size)

    def check_device(self, device: str, *, fp16: bool = True, bf16: bool = True, fp8: bool = True,
                     cuda: bool = True) -> None:
        """Refuse what the ranks' device cannot run: a precision, fp8 matmuls, CUDA Graphs."""
        if self.precision == "fp16" and not fp16:
            raise refuse("precision", f"fp16 is not supported on {device}", 'use precision="bf16" or "fp32"')
        if self.precision == "bf16" and not bf16:
            raise refuse("precision", f"bf16 is not supported on {device}", 'use precision="fp16" or "fp32"')
        if self.precision in FP8 and not fp8:
            raise refuse("precision", f"{self.precision} needs fp8 matrix units, which {device} does not have "
                         "(NVIDIA compute capability 8.9 or newer: L4, L40, RTX 4090, H100, H200, B200)",
                         'use precision="bf16" here, and fp8 on such a GPU')
        if self.cuda_graphs and not cuda:
            raise refuse("cuda_graphs", f"CUDA Graphs capture CUDA kernels, and the ranks run on {device}",
                         "set cuda_graphs=False (compile=True alone runs on the CPU), or use a CUDA device")

    def replace(self, **changes: Any) -> Config:
        """`dataclasses.replace`, validated."""
        return dataclasses.replace(self, **changes)

    # -- as data: config.json for runs outside the notebook (serialize.py) -------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON data (the model nested); `Config.from_dict` makes an equal Config of it."""
        return serialize.to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """The Config `data` describes (as `to_dict` writes it), validated; an unknown key is refused by name.

        Missing keys take their defaults, so a config.json written before a field existed still loads.
        """
        return serialize.from_dict(cls, data)

    def save(self, path: str | Path) -> Path:
        """Write this Config as JSON to `path`."""
        return serialize.save(self, path)

    @classmethod
    def load(cls, path: str | Path) -> Config:
        """The Config in the JSON file `path` (as `save` or `bench.export` write it)."""
        return serialize.load(cls, path)
