"""The notebook's handle on a training session: a pool of ranks, the model on them, and what it reported.

    with wb.Workbench(world_size=2) as bench:
        bench.apply(wb.Config(dp=2))
        bench.train(steps=50).wait()
        bench.apply(wb.Config(tp=2))      # reshard in place: training continues where it was
        bench.train(steps=50).wait()
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any

from workbench import checkpoints
from workbench.config import Config, ConfigError
from workbench.corpus import check_corpus
from workbench.emulation import Cluster, status_line
from workbench.emulation import rank as emulation
from workbench.emulation.cluster import agreed_dilation, emulation_for
from workbench.machine import Machine, world_size_warning
from workbench.pool import Handle, Pool, RemoteError
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.store import LayoutChange, TelemetryStore


class RankSession:
    """The commands a Workbench sends to the session on every rank (`workbench.engine.session`), one method each.

    The one narrow interface between the notebook's facade and the model on the
    ranks: each method runs its command on every rank and returns rank 0's
    answer (`train` returns at once, with a handle). Tests of the UI fake this
    interface instead of the pool.
    """

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def capabilities(self) -> dict[str, Any]:
        from workbench.engine import session

        return self.pool.run(session.capabilities)[0]

    def apply(self, cfg: Config, corpus: str | Path | None, telemetry: bool, fresh: bool) -> dict[str, Any]:
        from workbench.engine import session

        return self.pool.run(session.apply, cfg, corpus, telemetry, fresh)[0]

    def train(self, steps: int, run_id: str, saves: checkpoints.SaveSchedule | None) -> Handle:
        from workbench.engine import session

        return self.pool.run_async(session.train, steps, run_id, saves)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every rank's part of the training state, for the notebook to hold (`workbench.recovery`)."""
        from workbench.engine import session

        return self.pool.run(session.snapshot)

    def restore(self, snapshot: list[dict[str, Any]]) -> int:
        from workbench.engine import session

        return self.pool.run(session.restore, snapshot)[0]

    def save(self, directory: str, keep: int | None, nonce: str) -> str:
        from workbench.engine import session

        return self._checkpoint_command(session.save, directory, keep, nonce)

    def load(self, path: str, saved: dict[str, Any]) -> dict[str, Any]:
        from workbench.engine import session

        return self._checkpoint_command(session.load, path, saved)

    def _checkpoint_command(self, fn: Any, *args: Any) -> Any:
        """Run a checkpoint command on every rank; a CheckpointError raised there is raised here as itself."""
        try:
            return self.pool.run(fn, *args)[0]
        except RemoteError as e:
            if e.exc_type == "CheckpointError":
                raise checkpoints.CheckpointError(e.remote_message) from e
            raise


class Run:
    """Training running in the background on the ranks; the notebook stays free."""

    def __init__(self, bench: "Workbench", handle: Handle, run_id: str, steps: int) -> None:
        self._bench, self._handle, self.id, self.steps = bench, handle, run_id, steps

    @property
    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> list[StepMetrics]:
        """Block until the run ends; rank 0's metrics, one per step (a rank's failure is raised here)."""
        return self._handle.result(timeout)[0]

    def stop(self, timeout: float | None = None) -> list[StepMetrics]:
        """End the run at the next step boundary, every rank at the same step; returns what ran."""
        if hasattr(self._handle, "stop"):  # a run that recovers by itself: no new chunk either
            self._handle.stop()
        self._bench.pool.set_flag("stop", self.id)
        return self.wait(timeout)

    def __repr__(self) -> str:
        return f"Run(id={self.id}, steps={self.steps}, done={self.done})"


class Workbench:
    """A pool of ranks holding one model that notebook cells configure, train and inspect.

    world_size: ranks to start (local processes, one per GPU on CUDA). More than the machine's cores or available
    memory warns with the estimate; more than its memory holds (≈0.4 GB a rank) is refused unless oversubscribe=True.
    corpus: folder of text to train on; None is the Python standard library's source.
    telemetry: measure every step (compute/communication timeline through the compiled recording
    backend, memory by category, MFU); False runs plain gloo/NCCL and reports losses and times only.
    Other keyword arguments go to `Pool` (device, timeout_s, check_collectives, ...).
    pool, session: an existing pool to use (not closed with this Workbench), and the commands sent to its
    ranks (a `RankSession` over `pool` when None).
    cluster: the cluster this Workbench stands for (`wb.Cluster(...)` or a preset name such as "h100-ib"):
    every collective then takes what it would there, time-dilated (workbench/emulation). None: this machine's
    own links.
    """

    def __init__(self, world_size: int = 2, *, corpus: str | Path | None = None, telemetry: bool = True,
                 pool: Pool | None = None, session: RankSession | None = None, oversubscribe: bool = False,
                 cluster: Cluster | str | None = None, **pool_kwargs: Any) -> None:
        check_corpus(corpus)  # before any rank is spawned
        self.corpus, self.telemetry = corpus, telemetry
        self._owns_pool = pool is None
        self.cluster = emulation_for(cluster, pool.world_size if pool is not None else world_size, telemetry)
        """The emulated cluster, shaped for this pool's ranks; None when the links are this machine's own."""
        if pool is None:
            if not pool_kwargs.get("external") and (warning := world_size_warning(
                    world_size, Machine.this(), oversubscribe=oversubscribe)):
                warnings.warn(f"Workbench(world_size={world_size}): {warning}", stacklevel=2)
            setup = "workbench.telemetry.comm:register" if telemetry or self.cluster else None
            if setup:  # the ranks' flight rings, read while they hang, become the hang report's summary line
                from workbench.telemetry.flight import explain_diagnostics

                pool_kwargs.setdefault("explain", explain_diagnostics)
            pool = Pool(world_size, preload=("workbench.engine.session",), backend_setup=setup, **pool_kwargs)
        self.pool = pool
        # Where the ranks share when each issued each collective, under emulation (removed with this Workbench).
        self._arrivals = tempfile.mkdtemp(prefix="workbench-links-")
        weakref.finalize(self, shutil.rmtree, self._arrivals, True)
        if self.cluster is not None:
            self._emulate()
        self.session = RankSession(pool) if session is None else session
        """The commands this Workbench sends to the model on the ranks."""
        self.config: Config | None = None
        self.store = TelemetryStore()
        """Every rank's metrics and the layout changes, for plots to subscribe to."""
        self._run: Run | None = None
        self._unsubscribe = self.pool.subscribe(self.store.on_event)
        # Asked now, while the ranks are idle: later a run may hold them, and checking a config must not wait on it.
        self._capabilities = self.session.capabilities()

    # -- configure -------------------------------------------------------------------------------
    def check(self, cfg: Config) -> None:
        """Raise ConfigError if `cfg` cannot run on this pool (touches no rank's model)."""
        if not isinstance(cfg, Config):
            raise ConfigError(f"config: expected a wb.Config, got {type(cfg).__name__}. Fix: pass wb.Config(...).")
        cfg.check_world(self.pool.world_size)
        caps = self.capabilities
        cfg.check_device(caps["name"], fp16=caps["fp16"], bf16=caps["bf16"], fp8=caps.get("fp8", False),
                         cuda=caps["device"].startswith("cuda"))

    @property
    def capabilities(self) -> dict[str, Any]:
        """What the ranks' device supports (asked when the ranks start)."""
        return self._capabilities

    def apply(self, cfg: Config, *, fresh: bool = False) -> dict[str, Any]:
        """Build the model in `cfg`'s layout, or reshard the trained one into it; training state carries over.

        A new model (from cfg.seed, at step 0) starts when `fresh` is set or the model's shape or seed
        changed. An invalid config is refused before any rank is touched; the current model stays as it was.
        """
        self.check(cfg)
        check_corpus(self.corpus)  # the folder may have changed since the Workbench was made
        self._require_idle("apply a new layout")
        info = self.session.apply(cfg, self.corpus, self.telemetry, fresh)
        if not info["resharded"]:
            self.store.clear()  # a new model: its run starts at step 0
        history = self.history
        self.store.add_layout_change(history[-1].step + 1 if history else 0, cfg)
        self.config = cfg
        return info

    @property
    def history(self) -> list[StepMetrics]:
        """Rank 0's metrics of every step so far, across applies (the loss is the global batch's); a copy."""
        return self.store.steps(0)

    @property
    def layout_changes(self) -> list[LayoutChange]:
        """Where each layout took effect in the run."""
        return self.store.layout_changes

    # -- train -----------------------------------------------------------------------------------
    def train(self, steps: int = 100, *, save_every: int | None = None, save_to: str | Path | None = None,
              keep: int | None = None, async_save: bool = False, recover: bool = False, snapshot_every: int = 10,
              max_failures: int = 3) -> Run:
        """Start training for `steps` steps in the background; returns a Run at once.

        save_every=N, save_to="ckpt/": also save a checkpoint every N steps, keeping the last `keep`.
        async_save=True: each save copies the state to host memory and training goes on while it is written
        (the run ends once the last one is durable).
        recover=True: when a rank dies, freezes or hangs, restart the pool, rebuild the layout, restore the
        latest in-memory snapshot (taken every `snapshot_every` steps) and go on, the same losses as without the
        failure; `store.recoveries` records each one. It gives up after `max_failures` failures in a row
        without a completed chunk between them. See workbench/recovery.py.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"steps: must be a positive integer, got {steps!r}. Fix: pass e.g. steps=100.")
        if recover and (isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1):
            raise ConfigError(f"snapshot_every: must be a positive integer, got {snapshot_every!r}. "
                              "Fix: pass e.g. snapshot_every=10.")
        if self.config is None:
            raise RuntimeError("no model yet: call bench.apply(wb.Config(...)) first")
        self._require_idle("start another run")
        saves = checkpoints.schedule(save_every, save_to, keep, async_save)
        # Unique beyond this Workbench: a stop request is a flag on the ranks, which outlive it.
        run_id = secrets.token_hex(8)
        if recover:
            from workbench.recovery import RecoveringRun

            handle: Any = RecoveringRun(self, steps, run_id, saves, snapshot_every, max_failures)
        else:
            handle = self.session.train(steps, run_id, saves)
        self._run = Run(self, handle, run_id, steps)
        return self._run

    @property
    def running(self) -> Run | None:
        """The run in progress, if any."""
        return self._run if self._run is not None and not self._run.done else None

    def _require_idle(self, what: str) -> None:
        if self.running is not None:
            raise RuntimeError(f"cannot {what} while a run is training: call run.stop() (or run.wait()) first")

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str | Path, *, keep: int | None = None) -> Path:
        """Save model, optimizer, loss scale, data position, RNG states and Config as `path`/step-N.

        keep=K: delete all but the K latest complete checkpoints under `path` afterwards.
        """
        checkpoints.check_options(keep=keep)
        if self.config is None:
            raise RuntimeError("nothing to save: call bench.apply(wb.Config(...)) first")
        self._require_idle("save")
        directory = checkpoints.writable_directory(path)
        # The nonce names the save's temporary directory, the same on every rank.
        return Path(self.session.save(str(directory), keep, secrets.token_hex(4)))

    def load(self, path: str | Path) -> dict[str, Any]:
        """Load the newest checkpoint under `path` (or the one `path` names) into the current layout, whatever
        layout saved it.

        Without a model yet, the saved Config is applied first. Anything wrong with
        the checkpoint is found before the current model is touched; a damaged newest
        checkpoint is refused, naming the newest intact one (pass its path to load it).
        """
        self._require_idle("load a checkpoint")
        checkpoint_dir = checkpoints.resolve(path)
        manifest = checkpoints.verify(checkpoint_dir)
        if self.config is None:
            saved = checkpoints.config_from_json(manifest["config"])
            if saved.world_size != self.pool.world_size:
                raise checkpoints.CheckpointError(
                    f"{checkpoint_dir} was saved by {manifest['layout']} ({saved.world_size} ranks); this Workbench "
                    f"has {self.pool.world_size}: call bench.apply(cfg) with a layout for these ranks first, then load")
            self.apply(saved)
            # The layout took effect where the checkpoint resumes, not at step 0.
            self.store.clear()
            self.store.add_layout_change(manifest["next_step"], saved)
        info = self.session.load(str(checkpoint_dir), checkpoints.resume_state(manifest))
        self.store.truncate(manifest["next_step"])  # the steps after the checkpoint will run again
        return {"path": checkpoint_dir, "step": manifest["next_step"], "saved_layout": manifest["layout"], **info}

    # -- the large run ---------------------------------------------------------------------------
    def export(self, directory: str | Path, *, config: Config | None = None, **launch: Any):
        """Write what runs the current Config without the notebook into `directory`: config.json, run.sh (torchrun),
        run.sbatch (Slurm), accelerate.yaml and the nearest torchtitan run (torchtitan.sh for torchtitan 0.3,
        torchtitan.toml for older releases); returns `wb.export.Exported`.

        Keywords go to `Launch.for_config`: gpus_per_node (8), device ("cuda"), steps, save_every, async_save, port.
        """
        from workbench.export import export

        cfg = config or self.config
        if cfg is None:
            raise RuntimeError("nothing to export: call bench.apply(wb.Config(...)) first, or pass config=")
        return export(cfg, directory, **launch)

    def emulate(self, cluster: Cluster | str | None) -> str:
        """Stand for another cluster from now on (None: this machine's own links); returns `links`.

        The model and its training state stay as they are: only what communication costs changes.
        """
        self._require_idle("change the emulated cluster")
        self.cluster = emulation_for(cluster, self.pool.world_size, self.telemetry)
        if self.cluster is None:
            self.pool.run(emulation.uninstall)
        else:
            self._emulate()
        return self.links

    def _emulate(self) -> None:
        self.pool.run(emulation.install, self.cluster, self._arrivals)
        if self.pool.run(emulation.status)[0]["arrivals"] != "shared":  # ranks on several hosts estimate them
            self.pool.run(emulation.calibrate)

    # -- see ---------------------------------------------------------------------------------------
    @property
    def links(self) -> str:
        """One line: whether a cluster is emulated, which, and the time dilation the ranks paced the last step with."""
        if self.cluster is None or self.config is None:
            return status_line(self.cluster)
        histories = [self.store.steps(r) for r in range(self.pool.world_size)]
        return status_line(self.cluster, self.cluster.dilation or agreed_dilation(
            histories, self.cluster, self.config.precision))

    def dashboard(self, refresh_s: float = 0.3):
        """Controls and live plots in one widget: change the layout, train, watch what it does."""
        from workbench.ui.dashboard import dashboard

        return dashboard(self, refresh_s)

    def report(self, path: str | Path = "run.html") -> Path:
        """Write this session's plots and configs as one self-contained HTML file."""
        from workbench.ui.report import report

        return report(self, path)

    def restart(self) -> None:
        """Restart every rank (after a failure); the model is rebuilt in the current layout, untrained.

        Load a checkpoint afterwards to continue where training was. The pool's warm standby (ranks started
        ahead) makes this about a second; `train(recover=True)` does all of it by itself.
        """
        self.pool.restart()
        self._capabilities = self.session.capabilities()
        if self.cluster is not None:
            self._emulate()  # fresh ranks run on their own links until told
        if self.config is not None:
            self.apply(self.config, fresh=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """End every rank (of a pool this Workbench started); the model on them is gone (save first to keep it)."""
        self._unsubscribe()
        if self._owns_pool:
            self.pool.close()
        elif self.cluster is not None and not self.pool.broken:
            self.pool.run(emulation.uninstall)  # a shared pool goes back to its own links
        shutil.rmtree(self._arrivals, ignore_errors=True)

    def __enter__(self) -> "Workbench":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layout = self.config.layout if self.config else "no model"
        emulated = f", cluster={self.cluster.describe()}" if self.cluster is not None else ""
        return f"Workbench({self.pool!r}, layout={layout}, steps={len(self.history)}{emulated})"
