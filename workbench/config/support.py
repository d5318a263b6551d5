"""What a model is and which layout choices it supports, as plain values (the dashboard's model picker shows them).

Any model source is described by building it on the meta device (`workbench.models.check.describe`: the model
protocol's `layout_support` says, per choice, None or why not). The built-in model needs no build: its shape says
it all, from its own parameter arithmetic (`params.py`) and the reasons below, which the model protocol and the
built-in decoder give too. So the notebook imports no torch for it; a test holds `builtin_facts` to the built model's
own `describe` for every preset.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config.model import ModelConfig

AXES = ("dp", "zero", "tp", "pp", "cp", "ep", "activation_checkpointing", "compile")
"""The layout choices a model may or may not support (`CausalLM.layout_support`)."""

DENSE = "a dense model: no experts to split"
ONE_BLOCK = "one block: nothing to split into stages"
MOE_WHOLE_SEQUENCES = ("a mixture of experts routes whole sequences (its capacity and balancing loss are per "
                       "sequence), so splitting them would change the model")


@dataclass(frozen=True)
class ModelFacts:
    """What a model source is, as plain values."""

    name: str
    params: int
    """Parameters, a tied one once."""
    blocks: int
    support: dict[str, str | None]
    """Per layout choice (`AXES`): None where the model supports it, else why not."""


def builtin_facts(model: ModelConfig) -> ModelFacts:
    """The built-in decoder's facts, from its shape: every layout but expert parallel for a dense model, and context
    parallel for a mixture of experts; a pipeline needs two blocks."""
    support: dict[str, str | None] = dict.fromkeys(AXES)
    if model.n_experts:
        support["cp"] = MOE_WHOLE_SEQUENCES
    else:
        support["ep"] = DENSE
    if model.n_layers < 2:
        support["pp"] = ONE_BLOCK
    return ModelFacts(name=model.name, params=model.num_params, blocks=model.n_layers, support=support)
