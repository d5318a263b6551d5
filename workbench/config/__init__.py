"""What a run is: one frozen value, validated when it is made, in parts that each hold one idea.

- `run.py`        `Config`: the flat, keyword-only value every lane reads (`cfg.dp`, `cfg.zero`, ...).
- `model.py`      `ModelConfig` (the model's shape, validating itself) and the named `PRESETS`.
- `sources.py`    the other model sources: `HFModel` (a Hugging Face config, weights) and `CustomModel` (a factory).
- `params.py`     parameter counts of a shape: the one home for them (total, per block, matmul, MoE stored/active).
- `support.py`    what a model is and which layout choices it supports (`ModelFacts`); the built-in's from its shape.
- `degrees.py`    `Degrees` (pp, dp_replicate, dp_shard, cp, tp, ep) and the pure `MeshLayout` they make.
- `rules.py`      the rules across fields (`RULES`, in order), each refusal naming the field and a fix.
- `refusals.py`   `ConfigError`, the message shape, and type/range checks read from the type hints.
- `choices.py`    the allowed values of the choice fields, and `checkpointed_blocks`.
- `help_text.py`  what each choice means, for the controls and the notebooks.
- `serialize.py`  JSON: to_dict / from_dict / save / load, generic over fields.

Adding a field: declare it on `Config` (or `ModelConfig`) with a one-line
docstring; give its range in that module's `_RANGES` (its type is checked
from the hint); a rule that relates it to other fields is one function in
`rules.RULES`; its help text, if it is a choice, goes in `help_text.py`. JSON
needs nothing.
"""

from workbench.config.choices import (
    FP8,
    MX,
    CompileBackend,
    Compression,
    MixedPrecision,
    Optimizer,
    Precision,
    Recompute,
    Schedule,
    checkpointed_blocks,
    converts,
    low_precision_recipe,
)
from workbench.config.degrees import Degrees, MeshLayout, divisors
from workbench.config.help_text import (
    ASYNC_TP_HELP,
    COMPILE_HELP,
    COMPRESSION_HELP,
    CUDA_GRAPHS_HELP,
    MIXED_PRECISION_HELP,
    OFFLOAD_HELP,
    OPTIMIZER_HELP,
    PRECISION_HELP,
    RECOMPUTE_HELP,
    SCHEDULE_HELP,
    ZERO_HELP,
)
from workbench.config.model import PRESETS, ModelConfig
from workbench.config.refusals import ConfigError
from workbench.config.run import Config, keeps_weights
from workbench.config.sources import CustomModel, HFModel

__all__ = [
    "ASYNC_TP_HELP", "COMPILE_HELP", "COMPRESSION_HELP", "CUDA_GRAPHS_HELP", "CompileBackend", "Compression",
    "Config", "ConfigError", "CustomModel", "Degrees", "FP8", "HFModel", "MIXED_PRECISION_HELP", "MX", "MeshLayout",
    "MixedPrecision", "ModelConfig", "OFFLOAD_HELP", "OPTIMIZER_HELP", "Optimizer", "PRECISION_HELP", "PRESETS",
    "Precision", "RECOMPUTE_HELP", "Recompute", "SCHEDULE_HELP", "Schedule", "ZERO_HELP", "checkpointed_blocks",
    "divisors", "keeps_weights",
]
