"""Widgets that produce a `Config` and drive a Workbench: Apply, Train N steps, Stop, Restart.

Every change re-validates: a combination that `Config` or the pool refuses is
explained inline with the ConfigError's own message, and Apply stays disabled,
so nothing invalid is ever sent to the ranks. Button callbacks hand the work
to a background thread and return at once: the kernel stays free while the
ranks apply a layout or train, and the plots keep drawing.
"""

from __future__ import annotations

import dataclasses
import html
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.config import PRESETS, RECOMPUTE_HELP, SCHEDULE_HELP, ZERO_HELP, Config, ConfigError, ModelConfig, divisors
from workbench.config import COMPRESSION_HELP, OFFLOAD_HELP

if TYPE_CHECKING:
    from workbench.workbench import Workbench

_LABEL = {"description_width": "initial"}
_ROUTING = ("top_k", "capacity_factor", "aux_loss_coef")
"""The mixture-of-experts settings the controls edit on top of the chosen model (they do not change its weights)."""


def _toggle(description: str, options: list, value: Any, tooltip: str) -> widgets.ToggleButtons:
    return widgets.ToggleButtons(description=description, options=options, value=value,
                                 tooltips=[tooltip] * len(options), style=dict(_LABEL, button_width="auto"),
                                 layout=widgets.Layout(width="auto"))


class Controls:
    """The inputs for everything in a Config a user explores, the action buttons and the status lines."""

    def __init__(self, bench: "Workbench") -> None:
        self.bench = bench
        world = bench.pool.world_size
        cfg = bench.config or Config(dp=world, batch_size=max(16, world * 8))
        self._models: dict[str, ModelConfig] = dict(PRESETS)
        model_name = next((n for n, m in PRESETS.items() if _same_but_routing(m, cfg.model)), "current (custom)")
        self._models.setdefault(model_name, cfg.model)
        degrees = divisors(world)

        self.model = widgets.Dropdown(description="model", options=list(self._models), value=model_name,
                                      style=_LABEL, layout=widgets.Layout(width="180px"))
        self.dp = _toggle("dp", degrees, cfg.dp if cfg.dp in degrees else 1, "data-parallel degree")
        self.tp = _toggle("tp", degrees, cfg.tp if cfg.tp in degrees else 1, "tensor-parallel degree")
        self.pp = _toggle("pp", degrees, cfg.pp if cfg.pp in degrees else 1, "pipeline-parallel degree")
        self.ep = _toggle("ep", degrees, cfg.ep if cfg.ep in degrees else 1,
                          "expert-parallel degree: experts split across this many of the dp ranks")
        self.top_k = widgets.BoundedIntText(description="top-k", value=cfg.model.top_k, min=1, max=1024,
                                            style=_LABEL, layout=widgets.Layout(width="110px"))
        self.capacity_factor = widgets.FloatText(description="capacity factor", value=cfg.model.capacity_factor,
                                                 step=0.25, style=_LABEL, layout=widgets.Layout(width="170px"))
        self.aux_loss_coef = widgets.FloatText(description="aux loss coef", value=cfg.model.aux_loss_coef,
                                               step=0.01, style=_LABEL, layout=widgets.Layout(width="160px"))
        self.zero = _toggle("ZeRO", [0, 1, 2, 3], cfg.zero, "ZeRO stage across the dp ranks")
        self.schedule = widgets.Dropdown(description="schedule", options=list(SCHEDULE_HELP), value=cfg.schedule,
                                         style=_LABEL, layout=widgets.Layout(width="210px"))
        self.micro_batches = widgets.BoundedIntText(description="micro-batches", value=cfg.micro_batches, min=1,
                                                    max=1024, style=_LABEL, layout=widgets.Layout(width="150px"))
        self.stages_per_rank = widgets.BoundedIntText(description="stages/rank", value=cfg.stages_per_rank, min=1,
                                                      max=64, style=_LABEL, layout=widgets.Layout(width="140px"))
        self.recompute = _toggle("recompute", list(RECOMPUTE_HELP), cfg.activation_checkpointing,
                                 "activation checkpointing")
        self.precision = _toggle("precision", ["fp32", "bf16", "fp16"], cfg.precision, "compute precision")
        self.batch_size = widgets.BoundedIntText(description="batch", value=cfg.batch_size, min=1, max=1 << 20,
                                                 style=_LABEL, layout=widgets.Layout(width="130px"))
        self.seq_len = widgets.BoundedIntText(description="seq_len", value=cfg.seq_len, min=1, max=1 << 20,
                                              style=_LABEL, layout=widgets.Layout(width="140px"))
        self.lr = widgets.FloatText(description="lr", value=cfg.lr, step=1e-4, style=_LABEL,
                                    layout=widgets.Layout(width="140px"))
        self.compression = widgets.Dropdown(description="compression", options=list(COMPRESSION_HELP),
                                            value=cfg.compression, style=_LABEL, layout=widgets.Layout(width="210px"),
                                            tooltip="compression of the data-parallel gradient sync")
        self.offload = widgets.Checkbox(description="offload optimizer (ZeRO-Offload)", value=cfg.offload,
                                        indent=False, layout=widgets.Layout(width="240px"))
        self._kept = {"weight_decay": cfg.weight_decay, "seed": cfg.seed,  # not shown; carried over unchanged
                      "powersgd_rank": cfg.powersgd_rank}

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
        for button in (self.apply_button, self.train_button, self.stop_button, self.restart_button):
            button.layout.width = "110px"
        self.message = widgets.HTML()
        self.explain = widgets.HTML()
        self.status = widgets.HTML()

        self.config: Config | None = None
        """The Config the inputs describe, or None while they describe an impossible one."""
        self.error: str | None = None
        """Why the inputs are refused (the ConfigError's message), or None."""
        self._activity: str | None = None
        """What a button started and is still running, e.g. "applying dp2 …"."""
        self._outcome: tuple[bool, str] | None = None
        """(succeeded, message) of the last finished action."""
        self._token = 0  # identifies the latest action, so an older one's late end cannot overwrite it
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

        for w in self.inputs:
            w.observe(self._on_input, names="value")
        self.apply_button.on_click(lambda _: self.apply())
        self.train_button.on_click(lambda _: self.train())
        self.stop_button.on_click(lambda _: self.stop())
        self.restart_button.on_click(lambda _: self.restart())
        self.widget = self._layout()
        self.validate()

    @property
    def inputs(self) -> list[widgets.ValueWidget]:
        return [self.model, self.dp, self.tp, self.pp, self.zero, self.schedule, self.micro_batches,
                self.stages_per_rank, self.recompute, self.precision, self.batch_size, self.seq_len, self.lr,
                self.compression, self.offload, self.ep, self.top_k, self.capacity_factor, self.aux_loss_coef]

    def _layout(self) -> widgets.Widget:
        row = lambda *ws: widgets.HBox(list(ws), layout=widgets.Layout(flex_flow="row wrap", align_items="center",
                                                                        grid_gap="2px 14px"))
        return widgets.VBox([
            row(self.model, self.dp, self.tp, self.pp, self.zero),
            row(self.schedule, self.micro_batches, self.stages_per_rank, self.recompute, self.precision),
            row(self.batch_size, self.seq_len, self.lr, self.compression, self.offload),
            row(self.ep, self.top_k, self.capacity_factor, self.aux_loss_coef),
            row(self.apply_button, self.steps, self.train_button, self.stop_button, self.restart_button),
            self.message, self.explain, self.status,
        ], layout=widgets.Layout(border="1px solid #ddd", padding="6px 10px", margin="0 0 6px 0"))

    # -- inputs → Config ------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """The Config keyword arguments the inputs describe."""
        return dict(model=self._model(), ep=self.ep.value, dp=self.dp.value, tp=self.tp.value, pp=self.pp.value,
                    zero=self.zero.value, schedule=self.schedule.value, micro_batches=self.micro_batches.value,
                    stages_per_rank=self.stages_per_rank.value, activation_checkpointing=self.recompute.value,
                    precision=self.precision.value, batch_size=self.batch_size.value, seq_len=self.seq_len.value,
                    lr=self.lr.value, compression=self.compression.value, offload=self.offload.value, **self._kept)

    def _model(self) -> ModelConfig:
        """The chosen model, with the routing inputs applied when it is a mixture of experts."""
        model = self._models[self.model.value]
        if not model.n_experts:
            return model
        try:
            return dataclasses.replace(model, top_k=self.top_k.value, capacity_factor=self.capacity_factor.value,
                                       aux_loss_coef=self.aux_loss_coef.value)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. an empty number field: said inline like any refusal
            raise ConfigError(f"model: {e}") from e

    def set_config(self, cfg: Config) -> None:
        """Show `cfg` in the inputs (validated like any user change)."""
        name = next((n for n, m in self._models.items() if _same_but_routing(m, cfg.model)), None)
        if name is None:
            name = "current (custom)"
            self._models[name] = cfg.model
            self.model.options = list(self._models)
        self._kept = {"weight_decay": cfg.weight_decay, "seed": cfg.seed, "powersgd_rank": cfg.powersgd_rank}
        with self.model.hold_trait_notifications():
            for widget, value in ((self.model, name), (self.dp, cfg.dp), (self.tp, cfg.tp), (self.pp, cfg.pp),
                                  (self.zero, cfg.zero), (self.schedule, cfg.schedule),
                                  (self.micro_batches, cfg.micro_batches), (self.stages_per_rank, cfg.stages_per_rank),
                                  (self.recompute, cfg.activation_checkpointing), (self.precision, cfg.precision),
                                  (self.batch_size, cfg.batch_size), (self.seq_len, cfg.seq_len), (self.lr, cfg.lr),
                                  (self.compression, cfg.compression), (self.offload, cfg.offload),
                                  (self.ep, cfg.ep if cfg.ep in self.ep.options else 1),
                                  *((getattr(self, f), getattr(cfg.model, f)) for f in _ROUTING)):
                widget.value = value
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
        self.schedule.disabled = self.pp.value == 1
        self.stages_per_rank.disabled = self.pp.value == 1 or self.schedule.value != "interleaved_1f1b"
        dense = not self._models[self.model.value].n_experts
        for widget in (self.top_k, self.capacity_factor, self.aux_loss_coef):
            widget.disabled = dense  # routing settings of a mixture of experts; a dense model has none
        self._show()
        return self.config

    # -- actions (each returns at once; the work runs on a thread) -----------------------------------------
    def apply(self) -> threading.Thread | None:
        cfg = self.config
        token = self._begin(f"applying {cfg.layout} …") if cfg is not None else None
        if token is None:
            return None

        def apply() -> str:
            info = self.bench.apply(cfg)
            return f"applied {cfg.layout}" + ("" if info.get("resharded", True) else " (a new model, from step 0)")

        return self._spawn(token, apply)

    def train(self) -> threading.Thread | None:
        steps = self.steps.value
        token = self._begin(f"starting {steps} steps …")
        if token is None:
            return None
        try:
            run = self.bench.train(steps)  # returns at once; the run trains on the ranks
        except Exception as e:  # noqa: BLE001 - shown inline, e.g. "no model yet: call bench.apply"
            self._end(token, failure=str(e))
            return None
        self._set_activity(token, f"training {steps} steps …")

        def wait() -> str:
            done = run.wait()  # a rank's failure is raised here and shown inline
            return f"trained {len(done)} of {steps} steps" + (" (stopped)" if len(done) < steps else "")

        return self._spawn(token, wait)

    def stop(self) -> threading.Thread | None:
        run = self.bench.running
        if run is None:
            return None
        # stop() waits for the step boundary; the thread that started the run reports its end.
        thread = threading.Thread(target=run.stop, daemon=True, name="workbench-ui-stop")
        thread.start()
        return thread

    def restart(self) -> threading.Thread:
        # Allowed whatever is running (a hung run is what it is for); the interrupted action's own
        # failure then arrives with a stale token and is not shown over the restart's outcome.
        token = self._begin("restarting the ranks …", force=True)

        def restart() -> str:
            self.bench.restart()
            return "ranks restarted: the model was rebuilt untrained in the current layout (load a checkpoint to resume)"

        return self._spawn(token, restart)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the actions started so far are done (for tests and scripts)."""
        for thread in list(self._threads):
            thread.join(timeout)

    # -- state shown -------------------------------------------------------------------------------------
    def _begin(self, activity: str, force: bool = False) -> int | None:
        with self._lock:
            if self._activity is not None and not force:
                return None
            self._token += 1
            self._activity, self._outcome = activity, None
            token = self._token
        self._show()
        return token

    def _set_activity(self, token: int, activity: str) -> None:
        with self._lock:
            if token == self._token:
                self._activity = activity
        self._show()

    def _end(self, token: int, failure: str | None = None, done: str | None = None) -> None:
        with self._lock:
            if token != self._token:
                return
            self._activity = None
            self._outcome = (False, failure) if failure is not None else (True, done)
        self.validate()  # the pool's state may have changed what is allowed

    def _spawn(self, token: int, work: Callable[[], str]) -> threading.Thread:
        """Run `work` (which returns what to say when it is done) on a thread."""

        def run() -> None:
            try:
                done = work()
            except Exception as e:  # noqa: BLE001 - shown inline; the kernel stays free
                self._end(token, failure=f"{type(e).__name__}: {e}")
            else:
                self._end(token, done=done)

        thread = threading.Thread(target=run, daemon=True, name="workbench-ui-action")
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def refresh_status(self) -> None:
        """Re-read the pool's health and the current layout (the dashboard calls this on its timer)."""
        self._show()

    def _show(self) -> None:
        running = self.bench.running is not None  # also a run started from a cell
        busy = self._activity is not None or running
        self.apply_button.disabled = busy or self.config is None
        self.train_button.disabled = busy
        self.stop_button.disabled = not running
        outcome = self._outcome
        if self.error is not None:
            self.message.value = _line(False, self.error)
        elif outcome is not None and not outcome[0]:
            self.message.value = _line(False, outcome[1])
        else:
            self.message.value = _line(True, f"{self.config.layout}: valid on {self.bench.pool.world_size} ranks")
        self.explain.value = self._explanation()
        self.status.value = self._status_line()

    def _explanation(self) -> str:
        lines = [ZERO_HELP[self.zero.value]]
        if self.pp.value > 1:
            lines.append(SCHEDULE_HELP[self.schedule.value])
        lines.append(RECOMPUTE_HELP[self.recompute.value])
        if self.compression.value != "none":
            lines.append(COMPRESSION_HELP[self.compression.value])
        if self.offload.value:
            lines.append(OFFLOAD_HELP)
        if self.config is not None and self.config.model.n_experts:
            lines.append(MOE_HELP.format(cfg=self.config, m=self.config.model,
                                         capacity=self.config.model.expert_capacity(self.config.seq_len)))
        return "<div style='color:#444;font-size:12px;line-height:1.35'>" + "<br>".join(
            "ℹ " + html.escape(line, quote=False) for line in lines) + "</div>"

    def _status_line(self) -> str:
        pool, bench = self.bench.pool, self.bench
        health = (f'<span style="color:#b00020">broken: {html.escape(pool.broken_reason or "")}</span>'
                  if pool.broken else '<span style="color:#2e7d32">healthy</span>')
        layout = bench.config.layout if bench.config is not None else "no model yet"
        steps = len(bench.history)
        outcome = self._outcome
        activity = self._activity or (outcome[1] if outcome and outcome[0] else None) or "idle"
        parts = [f"<b>{pool.world_size} ranks</b>", html.escape(pool.device), html.escape(pool.backend or "?"), health,
                 f"layout <b>{html.escape(layout)}</b>", f"{steps} steps trained", html.escape(activity)]
        return "<div style='font-size:12px'>" + " · ".join(parts) + "</div>"


MOE_HELP = ("mixture of experts: {m.n_experts} experts, top-{m.top_k}, each expert takes at most {capacity} of a "
            "sequence's assignments (capacity factor {m.capacity_factor}); ep={cfg.ep}: "
            "experts split over that many dp ranks, tokens sent to them by all-to-all")


def _same_but_routing(a: ModelConfig, b: ModelConfig) -> bool:
    return a.same_weights(b) and a.n_experts == b.n_experts


def _line(ok: bool, text: str) -> str:
    color, mark = ("#2e7d32", "✓") if ok else ("#b00020", "✗")
    return f'<span style="color:{color}">{mark} {html.escape(text)}</span>'
