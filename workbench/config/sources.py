"""Model sources beside the built-in `ModelConfig`: a Hugging Face architecture (and its weights), a user's factory.

Pure values, like the rest of `Config`: frozen, validated when made, written to config.json and read back equal.
Nothing here imports torch or transformers: a source holds what builds the model (a config's JSON, a factory's
import path and arguments), and the ranks build it (`workbench.models.build`). What only the built model can say
(its parts found, its plan, its weights' names and shapes) is checked on the notebook side before any rank is
touched (`workbench.models.check`).

The shape facts the Config's rules read (`n_layers`, `n_heads`, `kv_heads`, `hidden_dim`, `n_experts`,
`max_seq_len`, `vocab_size`) carry the same names as `ModelConfig`'s; a `CustomModel` does not know them before it
is built, so they are None there and the built model is checked instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.config.model import BYTE_VOCAB
from workbench.config.refusals import ConfigError, refuse

HF = "huggingface"
CUSTOM = "custom"


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _folder(path: str | Path, what: str, field_name: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise refuse(field_name, f"{what} {str(path)!r} does not exist", "pass a local folder (nothing is downloaded)")
    return folder.resolve()


def _config_dict(config: Any) -> dict[str, Any]:
    """A transformers config object, a dict, or a local folder (or file) holding config.json → the config as a dict."""
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = _folder(config, "config folder", "model.config")
        path = path / "config.json" if path.is_dir() else path
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise refuse("model.config", f"cannot read {path} ({e})", "pass a folder holding a valid config.json") \
                from None
    if callable(getattr(config, "to_dict", None)):  # a transformers PretrainedConfig: not imported here
        return config.to_dict()
    raise refuse("model.config", f"expected a transformers config, a dict or a folder, got {type(config).__name__}",
                 'pass e.g. Qwen3Config(...), its .to_dict(), or "path/to/model" holding config.json')


def _int_or_none(data: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True, init=False, repr=False)
class HFModel:
    """A Hugging Face decoder-only causal LM built from its config, offline; optionally its weights.

    `HFModel(config, weights=None)`: `config` a transformers config object, a dict, or a local folder holding
    config.json; `weights` a local folder of .safetensors files (loaded straight into each rank's shard).
    """

    config_json: str
    """The transformers config as canonical JSON (sorted keys): what builds the model on every rank."""
    weights: str | None = None
    """Absolute path of a local folder of .safetensors files, or None: the model starts from its seeded init."""

    def __init__(self, config: Any, weights: str | Path | None = None) -> None:
        data = _config_dict(config)
        data.pop("_name_or_path", None)  # where it was read from, not what it is
        object.__setattr__(self, "config_json", _canonical(data))
        if weights is not None:
            folder = _folder(weights, "weights folder", "model.weights")
            if not folder.is_dir() or not any(folder.glob("*.safetensors")):
                raise refuse("model.weights", f"{folder} holds no .safetensors file",
                             "pass the folder a Hugging Face checkpoint (or bench.export_hf) wrote")
            weights = str(folder)
        object.__setattr__(self, "weights", weights)
        self._check()

    def __repr__(self) -> str:
        weights = f", weights={self.weights!r}" if self.weights else ""
        return f"HFModel({self.model_type}: {self.n_layers} layers, hidden {self.dim}{weights})"

    @property
    def config(self) -> dict[str, Any]:
        """The transformers config as a dict (a copy)."""
        return json.loads(self.config_json)

    def _check(self) -> None:
        data = self.config
        if not isinstance(data.get("model_type"), str):
            raise refuse("model.config", "the config has no model_type", "pass a transformers config (or its dict)")
        if data.get("is_encoder_decoder"):
            raise refuse("model.config", f"{data['model_type']} is an encoder-decoder model",
                         "use a decoder-only causal LM (Llama, Mistral, Qwen3, Gemma, Mixtral, ...)")
        for name, value in (("num_hidden_layers", self.n_layers), ("num_attention_heads", self.n_heads),
                            ("vocab_size", self.vocab_size)):
            if value is None or value < 1:
                raise refuse(f"model.config.{name}", f"must be a positive integer, got {data.get(name)!r}",
                             f"set {name} in the config")
        if self.vocab_size < BYTE_VOCAB:
            raise refuse("model.config.vocab_size", f"vocab_size={self.vocab_size} cannot embed the byte tokens",
                         f"use vocab_size ≥ {BYTE_VOCAB}")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if data.get(name) is not None:
                raise refuse(f"model.config.{name}", f"{data['model_type']} soft-caps its logits, which the "
                             "workbench's forward (embedding, blocks, norm, head) does not", f"set {name}=None")

    # -- the shape, as the Config's rules read it (ModelConfig's names) ---------------------------------------
    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def name(self) -> str:
        """Display name: the model type, and the weights' folder if any."""
        return self.model_type + (f" ({Path(self.weights).name})" if self.weights else "")

    @property
    def n_layers(self) -> int | None:
        return _int_or_none(self.config, "num_hidden_layers")

    @property
    def n_heads(self) -> int | None:
        return _int_or_none(self.config, "num_attention_heads")

    @property
    def kv_heads(self) -> int | None:
        return _int_or_none(self.config, "num_key_value_heads", "num_attention_heads")

    @property
    def head_dim(self) -> int | None:
        """Width of one attention head: the config's, else hidden_size / num_attention_heads."""
        explicit = _int_or_none(self.config, "head_dim")
        return explicit or (self.dim // self.n_heads if self.dim and self.n_heads else None)

    @property
    def hidden_dim(self) -> int | None:
        """The dense MLP's width, when the plan splits it (a mixture of experts' experts stay whole under tp)."""
        return None if self.n_experts else _int_or_none(self.config, "intermediate_size")

    @property
    def n_experts(self) -> int:
        return _int_or_none(self.config, "num_experts", "num_local_experts", "n_routed_experts") or 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes its tokens to experts (transformers' rule: every block of a mixture of experts
        but those in `mlp_only_layers`, and only every `decoder_sparse_step`-th where the config says one)."""
        data = self.config
        if not self.n_experts or layer in (data.get("mlp_only_layers") or []):
            return False
        return (layer + 1) % (_int_or_none(data, "decoder_sparse_step") or 1) == 0

    @property
    def vocab_size(self) -> int | None:
        return _int_or_none(self.config, "vocab_size")

    @property
    def dim(self) -> int | None:
        return _int_or_none(self.config, "hidden_size")

    @property
    def max_seq_len(self) -> int | None:
        return _int_or_none(self.config, "max_position_embeddings")

    @property
    def sliding_window(self) -> int | None:
        """The attention window of layers that have one (None: every layer attends to the whole past)."""
        data = self.config
        if data.get("use_sliding_window") is False:
            return None
        return _int_or_none(data, "sliding_window")

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def same_weights(self, other: Any) -> bool:
        """Whether `other` describes the same parameters (their trained state carries over a layout change)."""
        return self == other

    def to_data(self) -> dict[str, Any]:
        """As config.json holds it: the config as an object, not a string."""
        return {"source": HF, "config": self.config, "weights": self.weights}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> HFModel:
        _known_fields(data, cls, ("config", "weights"))
        return cls(data.get("config"), weights=data.get("weights"))


@dataclass(frozen=True, init=False)
class CustomModel:
    """A user's own nn.Module: `CustomModel("package.module:factory", plan={...}, parts={...}, **kwargs)`.

    The factory is imported on the ranks (the notebook's folder is on their path) and called with `kwargs` (plain
    JSON values, so config.json holds them); it returns an nn.Module mapping token ids to logits. `plan`: its
    tensor-parallel plan, {"layers.*.attn.q_proj": "colwise", ...} (transformers' style names); `parts`: where its
    embedding, blocks, norm and head are, {"blocks": "layers", ...}, where the workbench cannot find them itself.
    """

    factory: str
    """"package.module:callable", imported on the ranks."""
    kwargs_json: str = "{}"
    """The factory's keyword arguments as canonical JSON."""
    plan: tuple[tuple[str, str], ...] = ()
    """Tensor-parallel plan: (module pattern from the root, style) pairs; () for none."""
    parts: tuple[tuple[str, str | None], ...] = ()
    """(part, path) pairs naming the embedding, blocks, norm and head where they are not found by themselves."""

    def __init__(self, factory: str, plan: dict[str, str] | None = None, parts: dict[str, str | None] | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(factory, str) or factory.count(":") != 1 or not all(factory.split(":")):
            raise refuse("model.factory", f"expected 'package.module:callable', got {factory!r}",
                         'pass the factory\'s import path, e.g. "mymodels:build_model"')
        try:
            kwargs_json = _canonical(kwargs)
        except TypeError as e:
            raise refuse("model.kwargs", f"the factory's arguments must be plain JSON values ({e})",
                         "pass numbers, strings, lists and dicts") from None
        plan = dict(plan or {})
        for pattern, style in plan.items():
            if not isinstance(pattern, str) or not isinstance(style, str):
                raise refuse("model.plan", f"expected {{module pattern: style name}}, got {pattern!r}: {style!r}",
                             'pass e.g. plan={"layers.*.mlp.up_proj": "colwise"}')
        parts = dict(parts or {})
        unknown = set(parts) - {"embedding", "blocks", "norm", "head"}
        if unknown:
            raise refuse("model.parts", f"unknown part(s) {sorted(unknown)}", "name embedding, blocks, norm or head")
        object.__setattr__(self, "factory", factory)
        object.__setattr__(self, "kwargs_json", kwargs_json)
        object.__setattr__(self, "plan", tuple(sorted(plan.items())))
        object.__setattr__(self, "parts", tuple(sorted(parts.items())))

    @property
    def kwargs(self) -> dict[str, Any]:
        return json.loads(self.kwargs_json)

    @property
    def name(self) -> str:
        return self.factory

    # What only the built model knows: the rules skip them, `workbench.models.check` reads the model instead.
    n_layers = n_heads = kv_heads = head_dim = hidden_dim = vocab_size = dim = max_seq_len = None
    sliding_window = n_experts = None
    tied_embeddings = False

    def same_weights(self, other: Any) -> bool:
        return self == other

    def to_data(self) -> dict[str, Any]:
        return {"source": CUSTOM, "factory": self.factory, "plan": dict(self.plan), "parts": dict(self.parts),
                "kwargs": self.kwargs}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> CustomModel:
        _known_fields(data, cls, ("factory", "plan", "parts", "kwargs"))
        return cls(data.get("factory"), plan=data.get("plan"), parts=data.get("parts"), **(data.get("kwargs") or {}))


def _known_fields(data: dict[str, Any], cls: type, fields: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - {"source", *fields})
    if unknown:
        raise refuse(f"model.{unknown[0]}", f"unknown field(s) {unknown} for {cls.__name__}",
                     f"use {', '.join(fields)}")


SOURCES = {HF: HFModel, CUSTOM: CustomModel}
"""A model field's "source" in config.json → its class (absent: the built-in ModelConfig)."""


def source_from_data(data: dict[str, Any]) -> HFModel | CustomModel:
    kind = data.get("source")
    if kind not in SOURCES:
        raise ConfigError(f"model.source: {kind!r} is not a model source. Fix: use one of {sorted(SOURCES)}, or "
                          "the built-in model's fields.")
    return SOURCES[kind].from_data(data)
