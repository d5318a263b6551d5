"""The frozen shape of one pipeline rank's share of a layout: what every other module of the estimator reads.

Built once per rank from the Config; every figure after it (memory, FLOPs, collectives) is a pure function of
it. Every rank of a stage (across dp and tp) has the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from workbench.config import FP8, Config, checkpointed_blocks
from workbench.schedules import config_rank_stages, config_stages, rank_stage_layers
from workbench.config.params import block_linears, block_matmul_params, head_params, mlp_params, moe_ffn_params
from workbench.model_profile import ModelProfile


def ceil_div(a: float, b: int) -> int:
    return math.ceil(a / b)


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: its blocks, its parameter elements after the tensor-parallel split, its micro-batch."""

    cfg: Config
    rank: int
    """Pipeline rank (0 with pp = 1)."""
    layers: tuple[int, ...]
    """Global indices of the blocks this rank holds, in order (all its chunks when interleaved)."""
    chunk_layers: tuple[tuple[int, ...], ...]
    """The blocks of each of its stages, in `stages` order (equal in size, or as Config.stage_layers cut them)."""
    chunks: int
    """Pipeline stages (model chunks) per rank: stages_per_rank when interleaved, else 1."""
    stages: tuple[int, ...]
    """Global indices of the pipeline stages this rank holds (loop placement)."""
    boundaries: int
    """Stage boundaries this rank crosses per micro-batch: an input from the stage before (all but stage 0) and a
    gradient from the stage after (all but the last), each received and, by the neighbour, sent."""
    block_matmul: int
    """Weight-matrix elements of one dense block on this rank (÷tp)."""
    block_params: int
    """Parameter elements of one dense block on this rank: its matrices ÷tp and its two norms whole."""
    embedding: int
    head: int
    root: int
    """Parameter elements outside the blocks: the embedding (first stage), final norm and head (last stage)."""
    moe_layers: tuple[int, ...]
    """This rank's blocks whose FFN is a mixture of experts."""
    expert_params: int
    """Expert elements on this rank: synchronised (and under ZeRO sharded) over edp = dp/ep, not dp."""
    params: int
    """Parameter elements on this rank after the tensor-parallel split, before ZeRO sharding."""
    tensors: int
    """Parameter tensors on this rank (ZeRO-1 broadcasts each one)."""
    tokens: int
    """Tokens of one micro-batch on one dp rank: micro_batch_size·seq_len, ÷cp (a cp rank holds seq_len/cp of
    every sequence; its attention reads all of them)."""
    checkpointed: int
    """How many of this rank's blocks recompute their activations (checkpointed whole)."""
    checkpointed_layers: frozenset[int] = frozenset()
    """Which of them."""
    profile: ModelProfile | None = None
    """The model as traced (`workbench.model_profile`): its figures stand where the built-in model's formulas
    would; None: the built-in model's shape, from the formulas."""

    @property
    def shape(self):
        """The model's shape under the built-in's names: the traced model's (`TracedShape`), else the Config's."""
        return self.profile.shape if self.profile is not None else self.cfg.model

    @property
    def dim(self) -> int:
        """Width of the residual stream: the traced model's, else the built-in shape's."""
        return self.profile.dim if self.profile is not None else self.cfg.model.dim

    @property
    def vocab_size(self) -> int:
        """Columns of the logits: the traced model's, else the built-in shape's."""
        return self.profile.vocab_size if self.profile is not None else self.cfg.model.vocab_size

    @property
    def first(self) -> bool:
        """Holds the model's first stage (the embedding): pipeline rank 0, in loop and V placement alike."""
        return 0 in self.stages

    @property
    def last(self) -> bool:
        """Holds the model's last stage (norm and head): the last rank in loop placement, rank 0 in V placement."""
        return self.last_stage in self.stages

    @property
    def last_stage(self) -> int:
        """Global index of the model's last pipeline stage."""
        return self.cfg.pp * self.chunks - 1

    @property
    def sync(self) -> int:
        """Ranks that hold the same weights and average their gradients: dp, times cp."""
        return self.cfg.dp * self.cfg.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards over: all of `sync`, or under HSDP one shard group (dp/dp_replicate, times cp)."""
        return self.sync // self.cfg.dp_replicate if self.cfg.hsdp else self.sync

    @property
    def low_precision(self) -> bool:
        """bf16/fp16, or an fp8 recipe (whose Float8 linears keep bf16 beside them)."""
        return self.cfg.precision in ("bf16", "fp16", *FP8)

    @property
    def autocast(self) -> bool:
        """Whether autocast casts per use (low precision, unless FSDP2 mixed precision casts the parameters)."""
        return self.low_precision and self.cfg.mixed_precision != "fsdp"

    @property
    def act_bytes(self) -> int:
        """Bytes per element of what the matmuls compute: 2 under bf16/fp16 (and fp8's bf16), else 4."""
        return 2 if self.low_precision else 4

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream: 2 under FSDP2 mixed precision (bf16 parameters, bf16
        embedding output), else 4 (fp32, also under autocast: the embedding's output and the adds are fp32)."""
        return 2 if self.cfg.mixed_precision == "fsdp" else 4

    def block_linears(self, whole: bool = False, fused_qkv: bool = False) -> list[tuple[int, int]]:
        """(fan-in, fan-out) on this rank of the built-in block's seven linears, in the order they run: wq, wk, wv,
        wo, w1, w3, w2 (the first four attention's, the last three its dense FFN's); `whole`: as the model declares
        them, before tensor parallel splits them; `fused_qkv`: wq, wk and wv as one linear, wqkv (five linears)."""
        linears = block_linears(self.shape, 1 if whole else self.cfg.tp)
        if fused_qkv:
            (d, q), (_, kv) = linears[0], linears[1]
            linears = [(d, q + 2 * kv), *linears[3:]]
        return linears

    def is_checkpointed(self, layer: int) -> bool:
        return layer in self.checkpointed_layers

    def count_checkpointed(self, layers: tuple[int, ...]) -> int:
        """How many of `layers` recompute their activations."""
        return len(checkpointed_blocks(list(layers), self.cfg.activation_checkpointing))

    def residual(self) -> int:
        """One micro-batch's residual stream, sequence-sharded under tp: what a checkpointed block keeps, and what
        a pipeline stage receives and sends."""
        return ceil_div(self.residual_bytes * self.tokens * self.dim, self.cfg.tp)

    def saved_by_stage(self, kept: Callable[[tuple[int, ...]], int], edges: Callable[[bool, bool], int],
                       received: int) -> dict[int, int]:
        """Bytes one micro-batch leaves saved in each pipeline stage this rank holds, by global stage index: what
        `kept(its blocks)` says they keep, plus `edges(first, last)` around them on the first and last stage, less
        the `received` input of a stage after the first (torch's receive buffer for that micro-batch, held between
        steps whatever is in flight and counted under buffers)."""
        return {stage: kept(layers) + edges(stage == 0, stage == self.last_stage) - (received if stage > 0 else 0)
                for stage, layers in zip(self.stages, self.chunk_layers)}


def stage_shape(cfg: Config, rank: int, profile: ModelProfile | None = None) -> Stage:
    """Pipeline rank `rank`'s shape (from the traced `profile` where one is given)."""
    # V placement (zbv, dualpipev) gives rank r stages r and 2pp-1-r: rank 0 holds the first and the last.
    layers = rank_stage_layers(cfg, rank, profile.n_layers if profile is not None else None)
    return _shape(cfg, rank, tuple(config_rank_stages(cfg, rank)), tuple(layers), profile)


def chunk_shapes(st: Stage) -> list[Stage]:
    """Each pipeline stage (model chunk) `st`'s rank holds, as a shape of its own: what one forward or backward
    action of the schedule computes."""
    return [_shape(st.cfg, st.rank, (stage,), (layers,), st.profile)
            for stage, layers in zip(st.stages, st.chunk_layers)]


def _shape(cfg: Config, rank: int, stages: tuple[int, ...], chunk_layers: tuple[tuple[int, ...], ...],
           profile: ModelProfile | None = None) -> Stage:
    if profile is not None:
        return _traced_stage(cfg, rank, stages, chunk_layers, profile)
    m, tp = cfg.model, cfg.tp
    place, layers, first, last = _placement(cfg, rank, stages, chunk_layers)
    # Tensor parallel splits every weight matrix (head and embedding vocab-parallel); norms stay whole.
    block_matmul = block_matmul_params(m) // tp
    block_params = block_matmul + 2 * m.dim
    embedding = ceil_div(m.vocab_size, tp) * m.dim
    head = ceil_div(head_params(m), tp)
    root = first * embedding + last * (head + m.dim)
    # Mixture of experts: router, this rank's 1/ep of the stacked experts, the shared expert, all whole on every
    # tp rank, in place of the dense SwiGLU's 1/tp.
    moe_layers = tuple(i for i in layers if m.is_moe_layer(i))
    mlp = mlp_params(m)
    expert_params = len(moe_layers) * m.n_experts // cfg.ep * mlp
    # The MoE FFN's other parameters (router, shared expert): its stored total less the experts.
    moe_rest = moe_ffn_params(m) - m.n_experts * mlp
    params = len(layers) * block_params + root + len(moe_layers) * (moe_rest - mlp // tp) + expert_params
    # Parameter tensors: 7 matrices and 2 norm weights per block; embedding; final norm and head; per MoE layer the
    # router (and the shared expert's three matrices).
    tensors = 9 * len(layers) + first + 2 * last + len(moe_layers) * (1 + 3 * m.shared_expert)
    return Stage(
        **place, block_matmul=block_matmul, block_params=block_params, embedding=embedding, head=head,
        root=root, moe_layers=moe_layers, expert_params=expert_params, params=params, tensors=tensors,
    )


def _placement(cfg: Config, rank: int, stages: tuple[int, ...], chunk_layers: tuple[tuple[int, ...], ...]
               ) -> tuple[dict, tuple[int, ...], bool, bool]:
    """Where pipeline rank `rank`, holding `stages` of blocks `chunk_layers`, sits (the Stage fields that do not
    depend on the model's source), the blocks it holds, and whether it holds the first stage and the last."""
    layers = tuple(i for chunk in chunk_layers for i in chunk)
    chunks = config_stages(cfg)
    checkpointed = checkpointed_blocks(list(layers), cfg.activation_checkpointing)
    last_stage = cfg.pp * chunks - 1
    fields = dict(cfg=cfg, rank=rank, layers=layers, chunk_layers=chunk_layers, chunks=chunks, stages=stages,
                  boundaries=sum(s > 0 for s in stages) + sum(s < last_stage for s in stages),
                  tokens=cfg.micro_batch_size * cfg.seq_len // cfg.cp,
                  checkpointed=len(checkpointed), checkpointed_layers=frozenset(checkpointed))
    return fields, layers, 0 in stages, last_stage in stages


def stage_shapes(cfg: Config, profile: ModelProfile | None = None) -> list[Stage]:
    """Every pipeline rank's shape, in rank order; from the traced `profile` where one is given."""
    if profile is not None:
        check_profile(cfg, profile)
    return [stage_shape(cfg, rank, profile) for rank in range(cfg.pp)]


def traced_precision(cfg: Config) -> str:
    """The precision a trace of `cfg`'s model runs in: "fp32"; "low", bf16 autocast over fp32 parameters (bf16,
    fp16, fp8's bf16 beside the Float8 linears); "bf16_params" under FSDP2's mixed precision."""
    if cfg.precision == "fp32":
        return "fp32"
    return "bf16_params" if cfg.mixed_precision == "fsdp" else "low"


def check_profile(cfg: Config, profile: ModelProfile) -> None:
    """A profile describes one sequence length and precision, and a model of cfg.model's depth (where the Config
    knows it: a user's module says its depth only once built, and its profile is then what says it)."""
    low = traced_precision(cfg)
    depth = cfg.model.n_layers or profile.n_layers
    if (profile.seq_len, profile.precision, profile.n_layers) != (cfg.seq_len, low, depth):
        raise ValueError(f"the profile of {profile.name} was traced at seq_len={profile.seq_len}, precision "
                         f"{profile.precision!r}, {profile.n_layers} blocks; this Config runs seq_len={cfg.seq_len}, "
                         f"precision {low!r}, {cfg.model.n_layers} blocks: trace it for this Config")


def _traced_stage(cfg: Config, rank: int, stages: tuple[int, ...], chunk_layers: tuple[tuple[int, ...], ...],
                  profile: ModelProfile) -> Stage:
    """A pipeline rank's shape from a traced model: its parameters per block and around them, as traced."""
    tp, ep = cfg.tp, cfg.ep
    place, layers, first, last = _placement(cfg, rank, stages, chunk_layers)
    head_tp = tp if profile.head_split else 1
    embedding = ceil_div(profile.embedding_params, head_tp)
    head = ceil_div(profile.head_params, head_tp)
    moe_layers = tuple(i for i in layers if profile.block(i).expert_params)
    kinds = [profile.block(i) for i in layers]
    return Stage(
        **place,
        block_matmul=max((ceil_div(b.split_params, tp) for b in kinds), default=0),
        block_params=max((profile.block_params(i, tp, ep) for i in layers), default=0),
        embedding=embedding, head=head, root=first * embedding + last * (head + profile.norm_params),
        moe_layers=moe_layers, expert_params=sum(b.expert_params for b in kinds) // ep,
        params=profile.stage_params(layers, first, last, tp, ep),
        tensors=sum(b.tensors for b in kinds) + first + 2 * last, profile=profile,
    )
