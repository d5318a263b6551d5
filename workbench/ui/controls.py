"""Widgets that produce a `Config` and drive a Workbench: Apply, Train N steps, Stop, Restart, Save, Load,
Export, Report.

The inputs come from one table (`workbench.ui.fields.CONTROLS`). Every change re-validates: a combination
that `Config` or the pool refuses is explained inline with the ConfigError's own message, and Apply stays
disabled, so nothing invalid is ever sent to the ranks. Button callbacks hand the work to a background
thread and return at once (`workbench.ui.actions`): the kernel stays free while the ranks apply a layout or
train, and the plots keep drawing. What would discard trained weights (Restart, Load, a new model) asks first.
The status line says what runs now: the phase (spawning, building, resharding, loading, saving) or the
training's "step k/N · ETA", with "compiling on ranks 0, 1 …" while a torch.compile compilation runs.
"""

from __future__ import annotations

import dataclasses
import html
import threading
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.config import Config, ConfigError, keeps_weights
from workbench.ui.actions import ActionRunner, Confirm
from workbench.ui.fields import CONTROLS, Values, read
from workbench.ui.model_picker import ModelPicker

if TYPE_CHECKING:
    from workbench.workbench import Workbench

_LABEL = {"description_width": "initial"}


class Controls:
    """The inputs for everything in a Config a user explores, the action buttons and the status lines.

    The inputs come from the table `workbench.ui.fields.CONTROLS` (one row per Config field); each is an
    attribute named after its row (`controls.dp`, `controls.recompute`). The model is chosen by `picker`
    (`workbench.ui.model_picker`): a preset, a Hugging Face config folder or a factory of one's own; `model` is
    its dropdown.
    """

    def __init__(self, bench: "Workbench") -> None:
        self.bench = bench
        world = bench.pool.world_size
        cfg = bench.config or Config(dp=world, batch_size=max(16, world * 8))
        self._shown = cfg
        """The Config last shown in the inputs: fields without a control, and inactive ones, come from it."""
        self.picker = ModelPicker(cfg.model)
        self.model = self.picker.dropdown
        self.fields: dict[str, widgets.ValueWidget] = {}
        """The table's widgets by row name, in table order."""
        for control in CONTROLS:
            if hasattr(self, control.name):
                raise ValueError(f"control {control.name!r}: the name is taken on Controls; rename the row")
            widget = control.make(world)
            self.fields[control.name] = widget
            setattr(self, control.name, widget)
        self._show_values(cfg)

        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="check",
                                           tooltip="build this layout on the ranks (reshards a trained model)")
        self.steps = widgets.BoundedIntText(description="steps", value=50, min=1, max=1_000_000, style=_LABEL,
                                            layout=widgets.Layout(width="130px"))
        self.train_button = widgets.Button(description="Train", button_style="success", icon="play",
                                           tooltip="train this many steps in the background")
        self.stop_button = widgets.Button(description="Stop", button_style="warning", icon="stop",
                                          tooltip="stop the run at the next step boundary")
        self.restart_button = widgets.Button(description="Restart", button_style="danger", icon="refresh",
                                             tooltip="end every rank and start a fresh world (the model is lost)")
        self.path = widgets.Text(description="path", placeholder="each button has its own default", style=_LABEL,
                                 layout=widgets.Layout(width="250px"))
        self.save_button = widgets.Button(description="Save", icon="download",
                                          tooltip=f"save a checkpoint under path (default {DEFAULTS['save']}/)")
        self.load_button = widgets.Button(description="Load", icon="upload",
                                          tooltip=f"load the latest checkpoint under path (default {DEFAULTS['load']}/)")
        self.export_button = widgets.Button(description="Export", icon="share",
                                            tooltip=f"write the launch files of this layout to path "
                                                    f"(default {DEFAULTS['export']}/)")
        self.report_button = widgets.Button(description="Report", icon="file",
                                            tooltip=f"write every run as one HTML page (default {DEFAULTS['report']})")
        for button in (self.apply_button, self.train_button, self.stop_button, self.restart_button):
            button.layout.width = "100px"
        for button in (self.save_button, self.load_button, self.export_button, self.report_button):
            button.layout.width = "88px"
        self.message = widgets.HTML()
        self.explain = widgets.HTML()
        self.status = widgets.HTML()
        self.confirm = Confirm()
        """The question asked before discarding trained weights."""

        self.config: Config | None = None
        """The Config the inputs describe, or None while they describe an impossible one."""
        self.error: str | None = None
        """Why the inputs are refused (the ConfigError's message), or None."""
        self.closed = False
        self.actions = ActionRunner(self.validate)  # an action's end may change what is allowed

        for w in self.inputs:
            w.observe(self._on_input, names="value")
        self.apply_button.on_click(lambda _: self.apply())
        self.train_button.on_click(lambda _: self.train())
        self.stop_button.on_click(lambda _: self.stop())
        self.restart_button.on_click(lambda _: self.restart())
        self.save_button.on_click(lambda _: self.save())
        self.load_button.on_click(lambda _: self.load())
        self.export_button.on_click(lambda _: self.export())
        self.report_button.on_click(lambda _: self.report())
        self.widget = self._layout()
        self.validate()

    @property
    def inputs(self) -> list[widgets.ValueWidget]:
        return [*self.picker.inputs, *self.fields.values()]

    def _layout(self) -> widgets.Widget:
        row = lambda ws: widgets.HBox(list(ws), layout=widgets.Layout(flex_flow="row wrap", align_items="center",
                                                                       grid_gap="2px 14px"))
        members: dict[str, list[widgets.Widget]] = {"layout": [self.model]}
        for control in CONTROLS:
            members.setdefault(control.line, []).append(self.fields[control.name])
        self.lines = {name: row(ws) for name, ws in members.items()}
        """The lines of inputs by the name the table gives them."""
        buttons = (self.apply_button, self.steps, self.train_button, self.stop_button, self.restart_button)
        files = (self.path, self.save_button, self.load_button, self.export_button, self.report_button)
        first, *rest = self.lines.values()  # the model's own inputs and facts under the line that chooses it
        box = widgets.VBox([first, self.picker.widget, *rest, row(buttons + files), self.confirm.widget, self.message,
                            self.explain, self.status],
                           layout=widgets.Layout(border="1px solid #ddd", padding="6px 10px", margin="0 0 6px 0"))
        box.add_class("workbench-controls")
        return box

    # -- inputs → Config ------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """The Config keyword arguments the inputs describe (raises ConfigError for an impossible model edit)."""
        said = self._said(self.picker.source())  # a folder or factory the model sources refuse raises here
        changes: dict[str, Any] = {}
        for control in CONTROLS:
            if control.active(said):  # an input that does not apply leaves its field as shown
                _put(changes, control.path, self.fields[control.name].value)
        kwargs = {f.name: getattr(self._shown, f.name) for f in dataclasses.fields(self._shown)}
        kwargs["model"] = said.model
        for name, value in changes.items():
            kwargs[name] = _assemble(kwargs[name], value, name) if isinstance(value, dict) else value
        return kwargs

    def _said(self, model: Any = None) -> Values:
        """Every input's value by Config field (the chosen model as it is), to decide what applies and explain it."""
        said = {f.name: getattr(self._shown, f.name) for f in dataclasses.fields(self._shown)}
        said["model"] = model or self.picker.source_or(self._shown.model)
        for control in CONTROLS:
            if len(control.path) == 1:
                said[control.path[0]] = self.fields[control.name].value
        return Values(**said)

    def _show_values(self, cfg: Config) -> None:
        for control in CONTROLS:
            try:
                widget, value = self.fields[control.name], read(cfg, control.path)
            except AttributeError:
                continue  # the built-in model's routing, on another model: the input stays, inactive
            options = getattr(widget, "options", None)
            if options is not None and value not in [o[1] if isinstance(o, tuple) else o for o in options]:
                continue  # e.g. a degree this pool cannot offer: the widget keeps its own
            widget.value = value

    def set_config(self, cfg: Config) -> None:
        """Show `cfg` in the inputs (validated like any user change)."""
        self._shown = cfg
        name = self.picker.entry(cfg.model)  # before holding: a new entry changes the options
        with self.model.hold_trait_notifications():
            self.model.value = name
            self._show_values(cfg)
        self.validate()

    def _on_input(self, _change: dict) -> None:
        self.validate()

    def validate(self) -> Config | None:
        """Build the Config and check it against the pool; show why not when it is refused."""
        try:
            cfg = Config(**self.values())
            self.bench.check(cfg)
        except ConfigError as e:
            self.config, self.error = None, str(e)
        except Exception as e:  # noqa: BLE001 - e.g. a broken pool cannot be asked what its device supports
            self.config, self.error = None, f"cannot check this layout: {e}"
        else:
            self.config, self.error = cfg, None
        said = self._said(self.config.model if self.config is not None else None)
        for control in CONTROLS:
            self.fields[control.name].disabled = not control.active(said)
        self.picker.refresh(self.bench.describe_model)
        self._show()
        return self.config

    # -- actions (each returns at once; the work runs on a thread) -----------------------------------------
    def apply(self, confirmed: bool = False) -> threading.Thread | None:
        """Apply the Config the inputs describe; asks first when it would replace trained weights by a new model."""
        cfg = self.config
        if cfg is None or self.actions.activity is not None:
            return None
        bench = self.bench
        if not keeps_weights(bench.config, cfg, fresh=False) and self._asked(
                confirmed, f"{cfg.layout} is a new model: the weights trained so far ({{steps}} steps) are discarded on "
                "the ranks (their runs stay in the plots). Save first to keep them.", "Apply: new model",
                lambda: self.apply(confirmed=True)):
            return None
        token = self.actions.begin(f"applying {cfg.layout} …")
        if token is None:
            return None

        def apply() -> str:
            info = bench.apply(cfg)
            return f"applied {cfg.layout}" + ("" if info.get("resharded", True) else " (a new model, from step 0)")

        return self.actions.spawn(token, apply)

    def train(self) -> threading.Thread | None:
        steps = self.steps.value
        token = self.actions.begin(f"starting {steps} steps …")
        if token is None:
            return None
        try:
            run = self.bench.train(steps)  # returns at once; the run trains on the ranks
        except Exception as e:  # noqa: BLE001 - shown inline, e.g. "no model yet: call bench.apply"
            self.actions.end(token, failure=str(e))
            return None
        self.actions.set_activity(token, f"training {steps} steps …")

        def wait() -> str:
            done = run.wait()  # a rank's failure is raised here and shown inline
            return f"trained {len(done)} of {steps} steps" + (" (stopped)" if len(done) < steps else "")

        return self.actions.spawn(token, wait)

    def stop(self) -> threading.Thread | None:
        run = self.bench.running
        if run is None:
            return None
        # stop() waits for the step boundary; the thread that started the run reports its end.
        thread = threading.Thread(target=run.stop, daemon=True, name="workbench-ui-stop")
        thread.start()
        return thread

    def restart(self, confirmed: bool = False) -> threading.Thread | None:
        """Restart the ranks (asks first when trained weights would be lost)."""
        if self._asked(confirmed, "Restart ends every rank: the weights trained so far ({steps} steps) are lost "
                       "(their runs stay in the plots). Save first to keep them.", "Restart the ranks",
                       lambda: self.restart(confirmed=True)):
            return None
        # Allowed whatever is running (a hung run is what it is for); the interrupted action's own
        # failure then arrives with a stale token and is not shown over the restart's outcome.
        token = self.actions.begin("restarting the ranks …", force=True)

        def restart() -> str:
            self.bench.restart()
            return "ranks restarted: the model was rebuilt untrained in the current layout (load a checkpoint to resume)"

        return self.actions.spawn(token, restart)

    def _asked(self, confirmed: bool, question: str, yes: str, again) -> bool:
        """Ask `question` ("{steps}" filled in) before an action that discards trained weights, unless it is
        `confirmed` or nothing was trained; True when it asked (`again` runs the action on "yes")."""
        if confirmed or not self.bench.history:
            return False
        self.confirm.ask(question.format(steps=len(self.bench.history)), yes, again)
        return True

    def save(self) -> threading.Thread | None:
        return self._file_action("save", lambda path: f"saved {self.bench.save(path)}")

    def load(self, confirmed: bool = False) -> threading.Thread | None:
        """Load the latest checkpoint under the path (asks first when it replaces trained weights)."""
        if self._asked(confirmed, "Load replaces the weights on the ranks ({steps} steps trained) by the "
                       "checkpoint's (this history stays in the plots as its own run).", "Load the checkpoint",
                       lambda: self.load(confirmed=True)):
            return None

        def load(path: str) -> str:
            info = self.bench.load(path)
            return f"loaded {info['path']} (saved by {info['saved_layout']}): next step {info['step']}"

        return self._file_action("load", load)

    def export(self) -> threading.Thread | None:
        return self._file_action("export", lambda path: f"exported to {self.bench.export(path).directory}")

    def report(self) -> threading.Thread | None:
        return self._file_action("report", lambda path: f"wrote {self.bench.report(path)}")

    def _file_action(self, what: str, work) -> threading.Thread | None:
        path = self.path.value.strip() or DEFAULTS[what]
        token = self.actions.begin(f"{what} {path} …")
        if token is None:
            return None
        return self.actions.spawn(token, lambda: work(path))

    def wait(self, timeout: float | None = None) -> None:
        """Block until the actions started so far are done (for tests and scripts)."""
        self.actions.wait(timeout)

    # -- state shown -------------------------------------------------------------------------------------
    def refresh_status(self) -> None:
        """Re-read the pool's health, the phase and the progress (the dashboard calls this on its timer)."""
        self._show()

    def close(self, why: str) -> None:
        """Disable every input and button for good, saying why (the Workbench was closed)."""
        self.closed = True
        for w in (*self.inputs, self.steps, self.path, self.apply_button, self.train_button, self.stop_button,
                  self.restart_button, self.save_button, self.load_button, self.export_button, self.report_button):
            w.disabled = True
        self.message.value = _line(False, why)
        self.status.value = ""

    def _show(self) -> None:
        if self.closed:
            return
        running = self.bench.running is not None  # also a run started from a cell
        busy = self.actions.activity is not None or running
        self.apply_button.disabled = busy or self.config is None
        self.train_button.disabled = busy
        self.stop_button.disabled = not running
        for button in (self.save_button, self.load_button, self.export_button, self.report_button):
            button.disabled = busy
        outcome = self.actions.outcome
        if self.error is not None:
            self.message.value = _line(False, self.error)
        elif outcome is not None and not outcome[0]:
            self.message.value = _line(False, outcome[1])
        else:
            self.message.value = _line(True, f"{self.config.layout}: valid on {self.bench.pool.world_size} ranks")
        self.explain.value = self._explanation()
        self.status.value = self._status_line()

    def _explanation(self) -> str:
        said = self._said(self.config.model if self.config is not None else None)
        lines = [line for control in CONTROLS if (line := control.help(said))]
        return "<div style='color:#444;font-size:12px;line-height:1.35'>" + "<br>".join(
            "ℹ " + html.escape(line, quote=False) for line in lines) + "</div>"

    def _status_line(self) -> str:
        pool, bench = self.bench.pool, self.bench
        health = (f'<span style="color:#b00020">broken: {html.escape(pool.broken_reason or "")}</span>'
                  if pool.broken else '<span style="color:#2e7d32">healthy</span>')
        layout = bench.config.layout if bench.config is not None else "no model yet"
        parts = [f"<b>{pool.world_size} ranks</b>", html.escape(pool.device), html.escape(pool.backend or "?"), health,
                 f"layout <b>{html.escape(layout)}</b>", f"{len(bench.history)} steps trained",
                 f"<b>{html.escape(self._now())}</b>"]
        return "<div class='workbench-status' style='font-size:12px'>" + " · ".join(parts) + "</div>"

    def _now(self) -> str:
        """What runs now: the Workbench's phase, else a training's progress, else the last action's outcome."""
        run = self.bench.running
        if self.bench.phase is not None:
            return f"{self.bench.phase} …"
        if run is not None:
            compiling = self.bench.store.compiling()
            ranks = sorted({c.rank for c in compiling})
            now = f"compiling on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} … · " if ranks else ""
            return f"{now}training · {run.progress()}"
        outcome = self.actions.outcome
        return self.actions.activity or (outcome[1] if outcome and outcome[0] else None) or "idle"


DEFAULTS = {"save": "checkpoints", "load": "checkpoints", "export": "export", "report": "report.html"}
"""Where Save, Load, Export and Report write or read when the path box is empty (relative to the kernel's folder)."""


def _put(changes: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Record `value` for the field at `path` in a nested dict of changes."""
    for name in path[:-1]:
        changes = changes.setdefault(name, {})
    changes[path[-1]] = value


def _assemble(base: Any, changes: dict[str, Any], where: str) -> Any:
    """`base` (a nested config, e.g. the chosen ModelConfig) with `changes` applied, validated once per object."""
    nested = {k: _assemble(getattr(base, k), v, f"{where}.{k}") if isinstance(v, dict) else v
              for k, v in changes.items()}
    try:
        return dataclasses.replace(base, **nested)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. an empty number field: said inline like any refusal
        raise ConfigError(f"{where}: {e}") from e


def _line(ok: bool, text: str) -> str:
    color, mark = ("#2e7d32", "✓") if ok else ("#b00020", "✗")
    return f'<span style="color:{color}">{mark} {html.escape(text)}</span>'
