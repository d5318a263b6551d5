"""Hugging Face decoder-only causal LMs, adapted to the model protocol from their module tree and their config's plans.

One adapter for every family, not one file per family: transformers 5 builds every decoder-only causal LM the same
way, and says where its parts are.
- the parts: the input embedding and the output head are `get_input_embeddings()` / `get_output_embeddings()`;
  the blocks and the final norm are the config's pipeline plan (`base_model_pp_plan`: "embed_tokens", "layers",
  "norm"), under the base model's prefix ("model.");
- one block is called as the base model's forward calls it: `layer(hidden, attention_mask=..., position_ids=...,
  position_embeddings=(cos, sin))`, the cos/sin from the base model's rotary module at the positions the model is
  given, the mask None (causal attention) unless a sliding window shorter than the sequence needs one, built by
  transformers' own mask functions (per layer type where the config has `layer_types`);
- the tensor-parallel plan is the model's own (`_tp_plan`: "layers.*.self_attn.q_proj": "colwise", ...);
- the experts of a mixture of experts are transformers' experts modules (stacked 3-D weights, called with the
  router's choices: `experts(hidden, top_k_index, top_k_weights)`);
- attention goes through transformers' attention interface (`config._attn_implementation`), where context parallel
  registers its ring.

The model is built from its config with `AutoModelForCausalLM.from_config` (offline: no download, ever), in fp32,
with SDPA attention, its parameters on the meta device (`adapt.parameters_on_meta`): each rank then draws or reads
only its own shard (`workbench.models.init`). The family's own forward is not run; tests hold the adapter's forward
equal to it for every family listed in TESTED_FAMILIES.
"""

from __future__ import annotations

import inspect
import itertools
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing is ever downloaded

import torch
from torch import nn

from workbench.config.sources import HFModel
from workbench.models.adapt import adopt, outside, parameters_on_meta, path_of, routed_experts
from workbench.models.protocol import AttentionKernel, CausalLM, Parts, Unsupported

TESTED_FAMILIES = ("llama", "mistral", "qwen3", "gemma", "qwen3_moe", "mixtral")
"""Families whose adapted forward, layouts and checkpoints the tests hold to the family's own (tests/models)."""

_ring_names = itertools.count()


def hf_config(source: HFModel) -> Any:
    """The transformers config object of `source` (offline)."""
    from transformers import CONFIG_MAPPING

    data = source.config
    try:
        config_class = CONFIG_MAPPING[data["model_type"]]
    except KeyError:
        raise Unsupported(f"model_type {data['model_type']!r} is not an architecture this transformers knows") \
            from None
    return config_class.from_dict(data)


def build(source: HFModel) -> HFCausalLM:
    """The model `source` describes, adapted to the protocol, its parameters on the meta device."""
    from transformers import AutoModelForCausalLM

    config = hf_config(source)
    with parameters_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        except ValueError as e:  # a config class with no causal LM (an encoder, a vision model)
            raise Unsupported(f"{source.model_type}: no causal language model in transformers ({e})") from None
    model = adopt(model, HFCausalLM, find_parts(model))
    base = model.lm_parts.blocks.rpartition(".")[0]
    model.wb_rotary = next((path for path, m in outside(model, model.lm_parts.blocks)
                            if path.startswith(base) and "RotaryEmbedding" in type(m).__name__), None)
    return model


def find_parts(model: nn.Module) -> Parts:
    """The parts of a transformers causal LM, from its embeddings accessors and its pipeline plan."""
    name = type(model).__name__
    embedding = path_of(model, model.get_input_embeddings())
    head = path_of(model, model.get_output_embeddings())
    prefix = getattr(model, "base_model_prefix", "model")
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    blocks = next((f"{prefix}.{key}" for key in plan if isinstance(model.get_submodule(f"{prefix}.{key}"),
                                                                  (nn.ModuleList, nn.ModuleDict))), None)
    norm = f"{prefix}.norm" if "norm" in plan else None
    missing = [what for what, path in (("embedding", embedding), ("head", head), ("blocks", blocks)) if path is None]
    if missing:
        raise Unsupported(f"{name}: could not find its {', '.join(missing)} (from get_input_embeddings, "
                          "get_output_embeddings and the config's base_model_pp_plan): not a decoder-only causal LM "
                          "the workbench can lay out")
    return Parts(embedding=embedding, blocks=blocks, norm=norm, head=head)


class HFCausalLM(CausalLM):
    """The protocol for a transformers causal LM (mixed into its own class by `adopt`; see the module docstring)."""

    wb_rotary: str | None = None
    """The base model's rotary embedding module (it computes cos/sin for every block), if it has one."""

    def block_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor | None]]:
        positions = self.token_positions(hidden.shape[1], hidden.device)
        position_ids = positions[None]
        rotary = self.part(self.wb_rotary)
        cos_sin = rotary(hidden, position_ids=position_ids) if rotary is not None else None
        return position_ids, cos_sin, self._masks(hidden, position_ids)

    def call_block(self, block: nn.Module, hidden: torch.Tensor, inputs: Any) -> torch.Tensor:
        position_ids, cos_sin, masks = inputs
        mask = masks.get(getattr(block, "attention_type", "full_attention")) if masks else None
        out = block(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def _masks(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """Attention masks by layer type, or {} where causal attention alone is right: no window, or one no shorter
        than the sequence. Built at the whole sequence's length (under sequence parallel `hidden` holds a slice)."""
        window = sliding_window(self.config)
        length = position_ids.shape[1]
        if window is None or window >= length:
            return {}
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        whole = hidden.new_empty((hidden.shape[0], length, 1))
        kwargs = dict(config=self.config, inputs_embeds=whole, attention_mask=None, position_ids=position_ids)
        cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
        kwargs[cache] = None
        sliding = create_sliding_window_causal_mask(**kwargs)
        if getattr(self.config, "layer_types", None):
            return {"full_attention": create_causal_mask(**kwargs), "sliding_attention": sliding}
        return {"full_attention": sliding}  # no layer types: every layer has the window (Mistral)

    @property
    def block_tp_plan(self) -> dict[str, str]:
        """The model's own plan ("model.layers.*.self_attn.q_proj": "colwise", ...) inside a block."""
        prefix = self.lm_parts.blocks + ".*."
        plan = getattr(self, "_tp_plan", None) or {}
        return {key.removeprefix(prefix): style for key, style in plan.items() if key.startswith(prefix)}

    def routed_experts(self) -> list[Experts]:
        return routed_experts(self)

    def use_attention(self, kernel: AttentionKernel) -> None:
        """Register `kernel` in transformers' attention interface and make the model's config use it."""
        if not getattr(self, "_supports_attention_backend", False):
            raise Unsupported(f"{type(self).__name__}: its attention does not go through transformers' attention "
                              "interface, so context parallel cannot replace it")
        from transformers import AttentionInterface

        name = f"workbench_kernel_{next(_ring_names)}"
        AttentionInterface.register(name, _interface_function(kernel))
        self.config._attn_implementation = name

    def layout_support(self) -> dict[str, str | None]:
        support = super().layout_support()
        if self.config.tie_word_embeddings:
            tied = "the head shares the embedding's weight (tie_word_embeddings)"
            support["tp"] = support["tp"] or tied
            support["pp"] = support["pp"] or tied
        if not getattr(self, "_supports_attention_backend", False):
            support["cp"] = "its attention does not go through transformers' attention interface"
        elif getattr(self.config, "attention_dropout", 0.0):
            support["cp"] = "attention dropout, which the ring exchange does not apply"
        return support


def sliding_window(config: Any) -> int | None:
    """The attention window of the layers that have one, None where every layer sees the whole past."""
    if getattr(config, "use_sliding_window", None) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) else None


def _interface_function(kernel: AttentionKernel):
    """`kernel` in the shape transformers' attention interface calls: (module, q, k, v, mask, scaling=, dropout=,
    ...) → (output (batch, seq, heads, head_dim), no weights)."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if attention_mask is not None or dropout or kwargs.get("softcap"):
            raise Unsupported(f"{type(module).__name__}: an attention mask, dropout or soft-capping, which the "
                              "replaced attention does not apply")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernel(query, key, value, scale).transpose(1, 2), None

    return attention
