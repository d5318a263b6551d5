"""Before any rank builds it: whether a model source can run in a layout, and what the model is, as plain values.

`check_model(cfg)` builds the model on the meta device (nothing allocated; the same build the ranks run) and
refuses, as a ConfigError naming the field, the module and the fix, what `Config` alone could not see: parts that
cannot be found, a plan tp cannot split, attention context parallel cannot reach, experts expert parallel cannot
split, blocks the pipeline stages cannot share evenly, a checkpoint folder that does not fit the model (every
tensor named), a user's forward that is not embedding → blocks → norm → head. `describe(source)` says what the
model is for the dashboard: its name, its parameter count and, per layout choice, whether it supports it.
"""

from __future__ import annotations

import functools

import torch

from workbench.config import Config, ConfigError, CustomModel, HFModel, ModelConfig
from workbench.config.model import BYTE_VOCAB
from workbench.config.refusals import refuse
from workbench.config.support import ModelFacts
from workbench.config.tokenizer import tokenizer_info
from workbench.models.build import ModelSource, meta_model, parameter_count
from workbench.models.protocol import CausalLM, Unsupported
from workbench.models.tp import tp_problems
from workbench.schedules import config_stages

CHECKED_FORWARD_PARAMS = 50_000_000
"""A user's module up to this size is built whole on the host once, to hold its own forward to the protocol's."""


@functools.lru_cache(maxsize=8)
def checked_model(source: ModelSource) -> CausalLM:
    """`source`'s model on the meta device (cached: read it, do not change it); refusals as ConfigError."""
    try:
        return meta_model(source)
    except Unsupported as e:
        raise as_refusal(e) from None


def as_refusal(error: Unsupported, field: str = "model") -> ConfigError:
    """An adapter's refusal as the Config's: "field: problem. Fix: ..." (the adapters' messages say their fix)."""
    text = str(error)
    return ConfigError(f"{field}: {text}" if "Fix:" in text else f"{field}: {text}. Fix: see the model protocol "
                       "(docs/your_own_model.md).")


def describe(source: ModelSource) -> ModelFacts:
    """What `source` is, from its model built on the meta device (`workbench.config.support.ModelFacts`)."""
    model = checked_model(source)
    return ModelFacts(name=source.name, params=parameter_count(model), blocks=len(model.block_modules),
                      support=model.layout_support())


def check_model(cfg: Config) -> None:
    """Refuse what `cfg`'s model cannot run in `cfg`'s layout (module docstring); the built-in model's rules are
    all in Config."""
    if isinstance(cfg.model, ModelConfig):
        return
    try:
        _check(cfg, checked_model(cfg.model))
    except Unsupported as e:
        raise as_refusal(e) from None


def _check(cfg: Config, model: CausalLM) -> None:
    blocks, chunks = len(model.block_modules), cfg.pp * config_stages(cfg)
    if blocks % chunks:
        raise refuse("pp", f"{chunks} pipeline stages cannot share the model's {blocks} blocks evenly",
                     f"choose pp (times stages_per_rank) dividing {blocks}")
    support = model.layout_support()
    if cfg.tp > 1:
        problems = tp_problems(model, cfg.tp)
        if problems:
            raise refuse("tp", "; ".join(problems[:4]), "choose a tp that divides them, or give the model a plan")
    if cfg.cp > 1 and support["cp"]:
        raise refuse("cp", f"context parallel cannot replace this model's attention: {support['cp']}", "set cp=1")
    if cfg.ep > 1:
        _check_experts(model, cfg.ep)
    vocab = getattr(model.embedding_module, "num_embeddings", None)
    needed = tokenizer_info(cfg.tokenizer).vocab_size if cfg.tokenizer is not None else BYTE_VOCAB
    if vocab is not None and vocab < needed:
        what = f"the tokenizer's {needed:,} tokens" if cfg.tokenizer is not None else "the byte tokens"
        raise refuse("model", f"the embedding has {vocab:,} rows and cannot embed {what}",
                     f"build the model with a vocabulary ≥ {needed:,}")
    if isinstance(cfg.model, HFModel) and cfg.model.weights is not None:
        check_weights(cfg.model, model)
    if isinstance(cfg.model, CustomModel):
        check_forward(cfg.model)


def _check_experts(model: CausalLM, ep: int) -> None:
    try:
        experts = model.routed_experts()
    except Unsupported as e:
        raise as_refusal(e, "ep") from None
    if not experts:
        raise refuse("ep", f"ep={ep} splits experts, but the model has none", "set ep=1")
    uneven = [e.path for e in experts if e.n_experts % ep]
    if uneven:
        raise refuse("ep", f"ep={ep} does not divide the {experts[0].n_experts} experts of {uneven[0]}",
                     "choose an ep dividing the number of experts")


def check_weights(source: HFModel, model: CausalLM) -> None:
    """Refuse a weights folder that does not fit the model, naming every tensor that does not."""
    from workbench.models.weights import index, problems

    expected = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    aliases = {name: name for name, _ in model.named_parameters(remove_duplicate=False) if name not in expected}
    try:
        entries = index(source.weights)
    except (OSError, ValueError) as e:
        raise refuse("model.weights", f"cannot read the safetensors headers in {source.weights} ({e})",
                     "pass a folder of intact .safetensors files") from None
    found = problems(entries, expected, aliases)
    if found:
        shown = "\n  ".join(found[:20]) + (f"\n  ... and {len(found) - 20} more" if len(found) > 20 else "")
        raise ConfigError(f"model.weights: {source.weights} does not fit the model ({source.model_type}):\n  {shown}\n"
                          "Fix: pass the weights of this architecture and config (the config.json beside them).")


@functools.lru_cache(maxsize=8)
def check_forward(source: CustomModel) -> None:
    """A user's module small enough is built whole on the host (once per source): its own forward must give the
    logits the protocol's forward gives, or the workbench would train another model than the user's."""
    model = checked_model(source)
    if parameter_count(model) > CHECKED_FORWARD_PARAMS:
        return
    from workbench.models.build import build_whole
    from workbench.models.custom import load_factory

    ours = build_whole(source, seed=0)
    theirs = load_factory(source.factory)(**source.kwargs)
    theirs.load_state_dict(dict(ours.named_parameters()), strict=False)
    tokens = torch.randint(0, ours.embedding_module.num_embeddings, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), theirs(tokens)
    b = getattr(b, "logits", b)
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
        diff = float((a - b).abs().max()) if isinstance(b, torch.Tensor) and a.shape == b.shape else "shape"
        raise refuse("model", f"CustomModel({source.factory!r}): the workbench runs embedding → blocks → norm → head "
                     f"({source.name}'s parts as found: {model.lm_parts}), and the module's own forward gives other "
                     f"logits (max difference {diff}): it does something between its parts",
                     "define block_inputs(hidden) / call_block(block, hidden, inputs) on the module, or name its "
                     "parts=...")
