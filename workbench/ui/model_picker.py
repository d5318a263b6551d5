"""The model picker: a built-in preset, a Hugging Face config folder, or a factory of one's own, and what it is.

The dropdown lists the presets (and the shown Config's model when it is none of them), then two entries that open
inputs of their own:
- `HF_FOLDER`: a local folder holding config.json, as `from_pretrained` reads one (nothing is downloaded), and
  whether to load the .safetensors beside it: `wb.HFModel(folder, weights=folder if ticked else None)`. A folder is
  what a user of transformers has (a checkpoint they saved, `save_pretrained`, `bench.export_hf`); a family's bare
  config class would build its full published size, which no laptop trains.
- `FACTORY`: "package.module:factory", importable here and on the ranks (the notebook's folder is on their path),
  with its tensor-parallel plan and its keyword arguments as JSON: `wb.CustomModel(factory, plan=..., **kwargs)`.

The model sources make themselves from these inputs, so a folder or a factory they refuse is explained with their
own ConfigError, inline like any other refusal. Below the inputs, the chosen model's name, parameter count, blocks
and, per layout choice, whether its family supports it or why not, as the model layer says
(`Workbench.describe_model`): the picker only shows them.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from workbench.config import PRESETS, ConfigError, CustomModel, HFModel, ModelConfig

HF_FOLDER = "Hugging Face folder…"
FACTORY = "your own factory…"
LABELS = {"activation_checkpointing": "recompute"}
"""A layout choice's name as the controls call it, where it differs from the model layer's."""
_LABEL = {"description_width": "initial"}

Source = ModelConfig | HFModel | CustomModel


class ModelPicker:
    """The model line of the controls: `dropdown`, the inputs of a folder or a factory, and `facts`."""

    def __init__(self, shown: Source) -> None:
        self.models: dict[str, Source] = dict(PRESETS)
        """The dropdown's ready-made entries: the presets, and the model of a Config shown that was none of them."""
        self.dropdown = widgets.Dropdown(description="model", options=[*self.models, HF_FOLDER, FACTORY],
                                         style=_LABEL, layout=widgets.Layout(width="230px"))
        self.folder = _text("config folder", "a local folder holding config.json", 380)
        self.weights = widgets.Checkbox(description="load its weights (.safetensors)", indent=False,
                                        layout=widgets.Layout(width="240px"))
        self.factory = _text("factory", "package.module:factory", 300)
        self.plan = _text("tp plan", '{"layers.*.attn.q_proj": "colwise", ...} (optional)', 360)
        self.arguments = _text("arguments", '{"dim": 256, "layers": 4} (optional)', 260)
        self.facts = widgets.HTML()
        """The chosen model's name, parameter count, blocks and layout support, or the model's refusal."""
        self._lines = {HF_FOLDER: _row(self.folder, self.weights), FACTORY: _row(self.factory, self.plan,
                                                                                 self.arguments)}
        self.widget = widgets.VBox([*self._lines.values(), self.facts])
        """What the controls place under their first line."""
        self._described: tuple[Source, Any] | None = None
        self.show(shown)

    @property
    def inputs(self) -> list[widgets.ValueWidget]:
        """Every input whose change re-validates the controls."""
        return [self.dropdown, self.folder, self.weights, self.factory, self.plan, self.arguments]

    # -- inputs → a model source ------------------------------------------------------------------------------
    def source(self) -> Source:
        """The model the inputs describe; raises the model sources' own ConfigError for a folder or a factory they
        refuse (or arguments that are not JSON)."""
        chosen = self.dropdown.value
        if chosen == HF_FOLDER:
            folder = self.folder.value.strip()
            if not folder:
                raise ConfigError("model.config: no folder given. Fix: type a local folder holding config.json.")
            return HFModel(folder, weights=folder if self.weights.value else None)
        if chosen == FACTORY:
            plan = _json_object(self.plan.value, "model.plan", '{"layers.*.mlp.up_proj": "colwise"}')
            kwargs = _json_object(self.arguments.value, "model.kwargs", '{"dim": 256}')
            if "plan" in kwargs or "factory" in kwargs:
                raise ConfigError("model.kwargs: 'plan' and 'factory' are the picker's own fields. Fix: give the "
                                  "plan in its box, and rename the factory's argument.")
            return CustomModel(self.factory.value.strip(), plan=plan or None, **kwargs)
        return self.models[chosen]

    def source_or(self, fallback: Source) -> Source:
        """The model the inputs describe, or `fallback` while they describe none."""
        try:
            return self.source()
        except ConfigError:
            return fallback

    def show(self, model: Source) -> None:
        """Choose `model`'s entry (`entry`)."""
        self.dropdown.value = self.entry(model)

    def entry(self, model: Source) -> str:
        """The dropdown's entry for `model`: the folder or factory typed when it describes it, else a preset's,
        else a new "current (...)" entry, added to the options now."""
        if self.dropdown.value in (HF_FOLDER, FACTORY) and self.source_or(None) == model:
            return self.dropdown.value
        name = next((n for n, m in self.models.items() if _same(m, model)), None)
        if name is None:
            name = "current (custom)" if isinstance(model, ModelConfig) else f"current ({model.name})"
            self.models[name] = model
            self.dropdown.options = [*self.models, HF_FOLDER, FACTORY]
        return name

    # -- what is shown -----------------------------------------------------------------------------------------
    def refresh(self, describe: Callable[[Source], Any]) -> None:
        """Show the inputs the chosen entry needs, and what the chosen model is, as `describe` (the Workbench's
        `describe_model`) says; a model it refuses shows that refusal."""
        for entry, line in self._lines.items():
            line.layout.display = "flex" if self.dropdown.value == entry else "none"
        try:
            source = self.source()
        except ConfigError:
            self.facts.value = ""  # the controls' message says why
            return
        try:
            if self._described is None or self._described[0] != source:
                self._described = (source, describe(source))
            self.facts.value = facts_html(self._described[1])
        except ConfigError as e:
            self.facts.value = _refusal(str(e))
        except Exception as e:  # noqa: BLE001 - e.g. a factory that raises while it builds: said, not raised
            self.facts.value = _refusal(f"cannot describe this model: {type(e).__name__}: {e}")


def facts_html(facts: Any) -> str:
    """A model's facts (`workbench.models.check.ModelFacts`) as the picker shows them."""
    marks = " ".join(f'<span style="color:{"#2e7d32" if why is None else "#b00020"}">'
                     f'{"✓" if why is None else "✗"} {LABELS.get(axis, axis)}</span>'
                     for axis, why in facts.support.items())
    refusals = "".join(f"<br>✗ {LABELS.get(axis, axis)}: {html.escape(why)}"
                       for axis, why in facts.support.items() if why is not None)
    return (f"<div class='workbench-model' style='font-size:12px;line-height:1.4'><b>{html.escape(facts.name)}</b>"
            f" · {facts.params:,} parameters · {facts.blocks} blocks · layouts: {marks}"
            f"<span style='color:#555'>{refusals}</span></div>")


def _same(a: Source, b: Source) -> bool:
    """Whether a dropdown entry is `b`'s: a preset whatever its routing settings (the controls edit those)."""
    if isinstance(a, ModelConfig) and isinstance(b, ModelConfig):
        return a.same_weights(b) and a.n_experts == b.n_experts
    return a == b


def _json_object(text: str, field: str, example: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{field}: not JSON ({e}). Fix: type a JSON object, e.g. {example}.") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{field}: expected a JSON object, got {type(value).__name__}. Fix: type e.g. {example}.")
    return value


def _refusal(text: str) -> str:
    return f'<span style="color:#b00020;font-size:12px">✗ {html.escape(text)}</span>'


def _text(label: str, placeholder: str, width: int) -> widgets.Text:
    # Read when the user presses Enter or leaves the box, not at every key: a factory is imported to be checked.
    return widgets.Text(description=label, placeholder=placeholder, continuous_update=False, style=_LABEL,
                        layout=widgets.Layout(width=f"{width}px"))


def _row(*ws: widgets.Widget) -> widgets.HBox:
    return widgets.HBox(list(ws), layout=widgets.Layout(display="none", flex_flow="row wrap", align_items="center",
                                                        grid_gap="2px 14px"))
