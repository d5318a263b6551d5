"""Whether a model's tensor-parallel plan can split it over tp ranks: read from the model itself, before any rank.

The plan names modules inside a block with transformers' style names; `tp_problems` says, module by module, what
keeps a tp degree from splitting them: no plan at all, a style the workbench does not lay out, a plan that names no
module, a width or a head count that tp does not divide, a head shared with the embedding. The engine
translates the plan into DTensor styles (`engine/parallel/tensor_styles.py`); this is the half that needs no
process group, so the notebook refuses a layout before the ranks try it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from workbench.models.protocol import CausalLM

STYLES = {
    "colwise": "split by output columns (each rank its own heads / MLP slice)",
    "rowwise": "split by input rows, partial sums reduce-scattered onto the sequence shards",
    "colwise_rep": "split by output columns, the output gathered whole",
    "colwise_gather_output": "as colwise_rep",
    "rowwise_rep": "a whole input split on each rank, then as rowwise",
    "rowwise_split_input": "as rowwise_rep",
    "replicated_with_grad_allreduce": "whole on every rank, fed its slice (a per-head norm): gradients summed",
}
"""The style names a plan may use, with what each does."""
SPLITS_OUTPUTS = {"colwise", "colwise_rep", "colwise_gather_output"}
SPLITS_INPUTS = {"rowwise", "rowwise_rep", "rowwise_split_input"}


def matching(names: Iterable[str], pattern: str) -> list[str]:
    """The module names `pattern` matches, "*" standing for any one name ("mlp.experts.*.up")."""
    want = pattern.split(".")
    return [name for name in names if len(parts := name.split(".")) == len(want)
            and all(w in ("*", p) for w, p in zip(want, parts))]


def tp_problems(model: CausalLM, tp: int) -> list[str]:
    """What keeps `tp` ranks from splitting `model` by its plan, one line per module (empty: it can)."""
    plan = model.block_tp_plan
    if not plan:
        return [f"{type(model).__name__} has no tensor-parallel plan: give one (CustomModel(..., plan={{...}}))"]
    embedding, head = model.embedding_module, model.output_head
    if embedding is not None and head is not None and getattr(head, "weight", None) is getattr(embedding, "weight", 0):
        return [f"{model.lm_parts.head} shares the embedding's weight, which tp would have to split twice"]
    problems = [f"plan entry {pattern!r}: unknown style {style!r} (one of {', '.join(STYLES)})"
                for pattern, style in plan.items() if style not in STYLES]
    matched: set[str] = set()
    for path, block in model.block_paths():
        modules = dict(block.named_modules())
        for pattern, style in plan.items():
            for name in matching(modules, pattern):
                matched.add(pattern)
                # Said once for all blocks: the path with the block's index as "*".
                where = f"{path.rpartition('.')[0]}.*.{name}"
                problems += _divides(where, modules[name], style, tp, _head_dim(modules, name))
    if not matched:  # a family's entries may name modules only some blocks have (a dense MLP beside MoE layers)
        problems.append(f"no entry of the plan names a module of the blocks ({', '.join(plan)})")
    return sorted(set(problems), key=problems.index)


def _head_dim(modules: dict[str, nn.Module], name: str) -> int | None:
    """The head_dim of the attention module holding `name`, if one of its ancestors in the block says it."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        head_dim = getattr(modules[".".join(parts[:depth])], "head_dim", None)
        if isinstance(head_dim, int):
            return head_dim
    return None


def _divides(where: str, module: nn.Module, style: str, tp: int, head_dim: int | None) -> list[str]:
    if not isinstance(module, nn.Linear):
        return []
    if style in SPLITS_OUTPUTS:
        width = module.out_features
        if head_dim and width % head_dim == 0 and (width // head_dim) % tp:
            return [f"{where}: its {width // head_dim} heads do not divide tp={tp}"]
        if width % tp:
            return [f"{where}: its {width} output features do not divide tp={tp}"]
    if style in SPLITS_INPUTS and module.in_features % tp:
        return [f"{where}: its {module.in_features} input features do not divide tp={tp}"]
    return []
