"""Which pipeline stages each rank holds and which blocks each stage holds.

Two placements, as torch.distributed.pipelining names them:

- loop: rank r holds stages r, r+pp, r+2pp, ... (GPipe, 1F1B: one stage; the
  interleaved schedules: `stages_per_rank` of them);
- v: rank r holds stages r and 2pp-1-r (ZBV and DualPipeV: always two), so
  rank 0 holds the first and the last stage and the pipeline turns round on
  rank pp-1, which runs stages pp-1 and pp back to back without a send.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
"""The pipeline schedules, by the names a Config's `schedule` takes (`workbench.config` reads them here)."""
Placement = Literal["loop", "v"]


class PipelineConfig(Protocol):
    """What the schedules read of a run's layout (`workbench.config.Config` is one). A protocol rather than Config
    itself: config imports this package for its pipeline rules, so nothing here imports config back."""

    @property
    def pp(self) -> int: ...
    @property
    def schedule(self) -> Schedule: ...
    @property
    def stages_per_rank(self) -> int: ...
    @property
    def micro_batches(self) -> int: ...
    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Blocks per pipeline stage when given (uneven stages); () for an even split."""
    @property
    def model(self) -> Any:
        """The model's shape; its `n_layers` are split among the stages."""

MULTI_STAGE: tuple[str, ...] = ("interleaved_1f1b", "interleaved_zb")
"""Schedules that hold `stages_per_rank` stages per rank in loop placement."""
V_SHAPED: tuple[str, ...] = ("zbv", "dualpipev")
"""Schedules that hold exactly two stages per rank in V placement."""
SPLIT_BACKWARD: tuple[str, ...] = ("interleaved_zb", "zbv", "dualpipev")
"""Schedules that split a backward into its input-gradient (I) and weight-gradient (W) halves."""


def placement(schedule: Schedule) -> Placement:
    """How `schedule` lays stages on ranks: "v" for ZBV and DualPipeV, "loop" otherwise."""
    return "v" if schedule in V_SHAPED else "loop"


def splits_backward(cfg: PipelineConfig) -> bool:
    """Whether `cfg` runs a pipeline whose backwards are split into I and W halves."""
    return cfg.pp > 1 and cfg.schedule in SPLIT_BACKWARD


def virtual_stages(schedule: Schedule, pp: int, stages_per_rank: int) -> int:
    """Model chunks (pipeline stages) per rank: `stages_per_rank` under the interleaved schedules and 2 under the
    V-shaped ones when pp > 1, else 1."""
    if pp == 1:
        return 1
    if schedule in V_SHAPED:
        return 2
    return stages_per_rank if schedule in MULTI_STAGE else 1


def config_stages(cfg: PipelineConfig) -> int:
    """`virtual_stages` of a Config."""
    return virtual_stages(cfg.schedule, cfg.pp, cfg.stages_per_rank)


def split_layers(n_layers: int, n_stages: int, sizes: tuple[int, ...] = ()) -> list[range]:
    """The global block indices of each stage: n_stages runs of consecutive blocks, of the given `sizes` (blocks
    per stage, in stage order) or, without them, equal in size."""
    if sizes:
        if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 1:
            raise ValueError(f"stage sizes {sizes} must be {n_stages} counts of at least 1 block summing to "
                             f"{n_layers} layers")
        starts = [sum(sizes[:s]) for s in range(n_stages + 1)]
        return [range(starts[s], starts[s + 1]) for s in range(n_stages)]
    if n_layers % n_stages:
        raise ValueError(f"{n_stages} pipeline stages do not divide {n_layers} layers; choose a divisor of n_layers")
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def lighter_ends(n_layers: int, n_stages: int, first: int = 1, last: int = 1) -> tuple[int, ...]:
    """Blocks per stage with the first and last stages lighter, as torchtitan splits a model whose layers do not
    divide evenly (torchtitan/distributed/pipeline_parallel.py, `pipeline_parallel_first_stage_less_layers` and
    `..._last_stage_less_layers`, 1 each by default): the embedding counts as `first` blocks and the norm, head and
    loss as `last`, and the n_layers + first + last units are shared out as evenly as they go, the remainder one
    each to the first stages (`_generate_llm_fqn_per_model_part`). Llama 3.1 405B's 126 layers over 8 stages:
    (15, 16, 16, 16, 16, 16, 16, 15), what torchtitan's December 2024 runs split it into."""
    if n_stages == 1:
        return (n_layers,)
    units = n_layers + first + last
    base, extra = divmod(units, n_stages)
    sizes = [base + (s < extra) for s in range(n_stages)]
    sizes[0] -= first
    sizes[-1] -= last
    if min(sizes) < 1 or sum(sizes) != n_layers:
        raise ValueError(f"{n_layers} layers cannot be shared over {n_stages} stages with the first {first} and the "
                         f"last {last} lighter")
    return tuple(sizes)


def stages_of_rank(pp_rank: int, pp: int, stages_per_rank: int, style: Placement = "loop") -> list[int]:
    """The global stages rank `pp_rank` holds, in the order its chunks are built: loop r, r+pp, ...; v r, 2pp-1-r."""
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"V placement holds exactly 2 stages per rank, got {stages_per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_rank(stage: int, pp: int, style: Placement = "loop") -> int:
    """The pipeline rank that holds global `stage` (the inverse of `stages_of_rank`)."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def config_rank_stages(cfg: PipelineConfig, pp_rank: int) -> list[int]:
    """The global stages pipeline rank `pp_rank` holds under `cfg`."""
    return stages_of_rank(pp_rank, cfg.pp, config_stages(cfg), placement(cfg.schedule))


def config_split(cfg: PipelineConfig, n_layers: int | None = None) -> list[range]:
    """The global block indices of each pipeline stage under `cfg` (Config.stage_layers, or an even split);
    `n_layers`: the model's depth where its Config does not know it (a user's module, counted once built)."""
    return split_layers(n_layers or cfg.model.n_layers, cfg.pp * config_stages(cfg), cfg.stage_layers)


def rank_layers(cfg: PipelineConfig) -> list[tuple[int, ...]]:
    """The global block indices each pipeline rank holds, in its stages' order."""
    layers = config_split(cfg)
    return [tuple(i for stage in config_rank_stages(cfg, r) for i in layers[stage]) for r in range(cfg.pp)]


def rank_stage_layers(cfg: PipelineConfig, pp_rank: int, n_layers: int | None = None) -> list[tuple[int, ...]]:
    """The global block indices of each stage pipeline rank `pp_rank` holds, one tuple per stage in its order
    (`n_layers` as `config_split` takes it)."""
    layers = config_split(cfg, n_layers)
    return [tuple(layers[stage]) for stage in config_rank_stages(cfg, pp_rank)]
