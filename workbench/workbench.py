"""The notebook's handle on a training session: a pool of ranks, the model on them, and what it reported.

    with wb.Workbench(world_size=2) as bench:
        bench.apply(wb.Config(dp=2))
        bench.train(steps=50).wait()
        bench.apply(wb.Config(tp=2))      # reshard in place: training continues where it was
        bench.train(steps=50).wait()
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench import checkpoints, kernel
from workbench.config import Config, ConfigError
from workbench.corpus import check_corpus
from workbench.emulation import Cluster, status_line
from workbench.emulation import rank as emulation
from workbench.emulation.cluster import emulation_for, target_compute_s
from workbench.machine import Machine, world_size_warning
from workbench.pool import Handle, Pool
from workbench.rank_session import RankSession
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.runs import LayoutChange, RunRecord
from workbench.telemetry.store import TelemetryStore

log = logging.getLogger("workbench")

SESSION_MODULE = "workbench.engine.session"
"""What a Workbench's ranks preload: the engine every command runs in."""
RECORDING_BACKEND = "workbench.telemetry.comm:register"
"""The torch.distributed backend a Workbench's ranks use with telemetry: gloo or NCCL, every collective recorded."""


def prepare_ahead() -> bool:
    """Start preparing a Workbench's local ranks now (its default pool: telemetry on), so that a Workbench made in a
    later cell forks them at once instead of waiting for torch and the engine to import (`Pool` docs): the user's
    standby, taken over from an earlier kernel when one runs. `import workbench` does this in a notebook kernel;
    $WORKBENCH_ZYGOTE=0 turns it off ($WORKBENCH_STANDBY=0 keeps it to this kernel)."""
    from workbench.pool.pool import prepare_ahead as prepare_pool

    return prepare_pool(preload=(SESSION_MODULE,), backend_setup=RECORDING_BACKEND)


class Run:
    """Training running in the background on the ranks; the notebook stays free."""

    def __init__(self, bench: "Workbench", handle: Handle, run_id: str, steps: int, first_step: int = 0) -> None:
        self._bench, self._handle, self.id, self.steps = bench, handle, run_id, steps
        self.first_step = first_step
        """The step it started at."""
        self._started = time.monotonic()

    def progress(self):
        """How far it is: `Progress(done, total, eta_s)`, from the steps the ranks have reported so far."""
        from workbench.telemetry.run_summary import progress

        done = sum(1 for m in self._bench.history if m.step >= self.first_step)
        return progress(done, self.steps, time.monotonic() - self._started, finished=self.done)

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
    backend, memory by category, MFU; a dense layout's activations on sampled steps, each step saying which one
    measured them: StepMetrics.activations_step); False runs plain gloo/NCCL and reports losses and times only.
    Other keyword arguments go to `Pool` (device, timeout_s, check_collectives, ...).
    standby: CPU ranks are forked by the user's standby, a prepared process that outlives this kernel, so that the
    next kernel's first Workbench starts at once too (workbench/pool/user_standby.py; `pool.ranks_from` says where
    they came from); False keeps them to a process of this kernel's own, which ends with it.
    pool, session: an existing pool to use (not closed with this Workbench), and the commands sent to its
    ranks (a `RankSession` over `pool` when None).
    cluster: the cluster this Workbench stands for (`wb.Cluster(...)` or a preset name such as "h100-ib"):
    every collective then takes what it would there, time-dilated (workbench/emulation). None: this machine's
    own links.
    exclusive: one live Workbench per kernel: starting this one closes the previous exclusive one (its ranks
    end, its dashboards stop), so re-running `bench = wb.Workbench(2)` never leaves a second pool on the same
    cores. None (the default) means True inside a Jupyter kernel, False in scripts (which may hold two on
    purpose, e.g. to compare); a Workbench over a given `pool` is never exclusive.
    """

    def __init__(self, world_size: int = 2, *, corpus: str | Path | None = None, telemetry: bool = True,
                 pool: Pool | None = None, session: RankSession | None = None, oversubscribe: bool = False,
                 cluster: Cluster | str | None = None, exclusive: bool | None = None, **pool_kwargs: Any) -> None:
        check_corpus(corpus)  # before any rank is spawned
        self.corpus, self.telemetry = corpus, telemetry
        self.closed = False
        self.phase: str | None = None
        """What the Workbench is doing now, for the status line: "spawning", "building", "resharding",
        "loading", "saving", or None."""
        self._owns_pool = pool is None
        exclusive = pool is None and (kernel.in_kernel() if exclusive is None else exclusive)
        if exclusive:
            kernel.close_previous()  # before spawning: the old ranks must not share the cores with the new ones
        self.cluster = emulation_for(cluster, pool.world_size if pool is not None else world_size, telemetry)
        """The emulated cluster, shaped for this pool's ranks; None when the links are this machine's own."""
        if pool is None:
            if not pool_kwargs.get("external") and (warning := world_size_warning(
                    world_size, Machine.this(), oversubscribe=oversubscribe)):
                warnings.warn(f"Workbench(world_size={world_size}): {warning}", stacklevel=2)
            setup = RECORDING_BACKEND if telemetry or self.cluster else None
            if setup:  # the ranks' flight rings, read while they hang, become the hang report's summary line
                from workbench.telemetry.flight import explain_diagnostics

                pool_kwargs.setdefault("explain", explain_diagnostics)
            pool = Pool(world_size, preload=(SESSION_MODULE,), backend_setup=setup, **pool_kwargs)
        self.pool = pool
        # Where the ranks share when each issued each collective, under emulation (removed with this Workbench).
        self._arrivals = tempfile.mkdtemp(prefix="workbench-links-")
        weakref.finalize(self, shutil.rmtree, self._arrivals, True)
        if self.cluster is not None:
            self._emulate()
        self.session = RankSession(pool) if session is None else session
        """The commands this Workbench sends to the model on the ranks."""
        self.config: Config | None = None
        self._prepared: tuple[str | Path | None, str | None] | None = None
        """The corpus and tokenizer whose shard the notebook last made sure of (`_prepare_data`)."""
        self.store = TelemetryStore()
        """Every rank's metrics and the layout changes, for plots to subscribe to."""
        self._run: Run | None = None
        self._unsubscribe = self.pool.subscribe(self.store.on_event)
        # Asked now, while the ranks are idle: later a run may hold them, and checking a config must not wait on it.
        self._capabilities = self.session.capabilities()
        if exclusive:
            kernel.claim(self)

    # -- configure -------------------------------------------------------------------------------
    def check(self, cfg: Config) -> None:
        """Raise ConfigError if `cfg` cannot run on this pool (touches no rank's model)."""
        if not isinstance(cfg, Config):
            raise ConfigError(f"config: expected a wb.Config, got {type(cfg).__name__}. Fix: pass wb.Config(...).")
        cfg.check_world(self.pool.world_size)
        caps = self.capabilities
        cfg.check_device(caps["name"], fp16=caps["fp16"], bf16=caps["bf16"], fp8=caps.get("fp8", False),
                         cuda=caps["device"].startswith("cuda"))
        if self.cluster is not None and self.cluster.dilation is None:
            try:  # the measured dilation divides by the cluster GPU's estimated compute of this layout
                target_compute_s(cfg, self.cluster, 0)
            except ValueError as e:
                raise ConfigError(f"cluster: the {self.cluster.gpu.name}'s compute of {cfg.layout}, which the "
                                  f"measured time dilation divides by, cannot be estimated: {e}. Fix: "
                                  "wb.Cluster(..., dilation=<a number>), or a layout that GPU runs") from None

    @property
    def capabilities(self) -> dict[str, Any]:
        """What the ranks' device supports (asked when the ranks start)."""
        return self._capabilities

    def apply(self, cfg: Config, *, fresh: bool = False, run: str | None = None) -> dict[str, Any]:
        """Build the model in `cfg`'s layout, or reshard the trained one into it; training state carries over.

        A new model (from cfg.seed, at step 0) starts when `fresh` is set or the model's shape or seed
        changed. An invalid config is refused before any rank is touched; the current model stays as it was.
        Each apply starts a run (`bench.runs`), named `run` if given; earlier runs are kept.
        """
        return self._apply(cfg, fresh=fresh, run=run)

    def _apply(self, cfg: Config, *, fresh: bool, run: str | None = None, origin: str | None = None) -> dict[str, Any]:
        self.check(cfg)
        check_corpus(self.corpus)  # the folder may have changed since the Workbench was made
        self._require_idle("apply a new layout")
        self._prepare_data(cfg)
        phase = "resharding" if keeps_weights(self.config, cfg, fresh) else "building"
        with self._doing(phase):
            info = self.session.apply(cfg, self.corpus, self.telemetry, fresh)
        resharded = bool(info["resharded"])
        self.store.start_run(cfg, self._next_step() if resharded else 0, continues=resharded, origin=origin, name=run,
                             predicted_memory=self._predicted_memory(cfg))
        self.config = cfg
        return info

    def _prepare_data(self, cfg: Config) -> None:
        """Tokenise the corpus into the data cache here, with a progress bar, before the ranks map it (they would
        build it themselves, with nothing to show for the wait); what cannot be read is refused before any rank
        is touched. Once per corpus and tokenizer: the ranks keep their data across layouts."""
        from workbench.documents import DocumentError
        from workbench.shards import prepare

        if self._prepared == (self.corpus, cfg.tokenizer):
            return
        try:
            prepare(self.corpus, tokenizer=cfg.tokenizer, progress=True)
        except ConfigError:
            raise
        except DocumentError as e:
            raise ConfigError(f"corpus: {e.problem}. Fix: {e.fix}.") from None
        except ValueError as e:  # no text in it: the message says what to point it at
            raise ConfigError(f"corpus: {e}.") from None
        self._prepared = (self.corpus, cfg.tokenizer)

    def _predicted_memory(self, cfg: Config) -> dict[int, dict[str, int]]:
        """Each rank's memory as the estimator predicts it for `cfg` on these ranks' device, for the memory plot;
        {} where no hardware profile describes the device, or the estimator cannot price the layout there."""
        from workbench.tracing.estimate import estimate  # any model: traced where it is not the built-in one
        from workbench.estimate.compare import predicted_memory
        from workbench.hardware import cpu_with_peak, profile_for

        profile = profile_for(self.capabilities["device"], self.capabilities.get("name", ""))
        if profile is None:
            return {}
        # The CPU model's memory does not read the matmul peak; the ranks measure it with their first steps.
        hardware = cpu_with_peak(cfg.precision, 1.0) if profile == "cpu" else profile
        try:
            return predicted_memory(estimate(cfg, hardware), cfg)
        except Exception:  # noqa: BLE001 - the ranks already hold the layout: a missing prediction must not undo it
            log.warning("no memory estimate for %s", cfg.layout, exc_info=True)
            return {}

    @contextlib.contextmanager
    def _doing(self, phase: str) -> Iterator[None]:
        """Say `phase` in the status line while the block runs."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def _next_step(self) -> int:
        """The step the model on the ranks trains next, as the store saw it."""
        current = self.store.snapshot().current
        if current is None:
            return 0
        steps = current.steps(0)
        return steps[-1].step + 1 if steps else current.first_step

    @property
    def runs(self) -> Any:
        """Every run of this Workbench (one per apply, kept across restarts and new models) with its figures:
        a pandas DataFrame indexed by run id when pandas is installed, else a list of row dicts."""
        from workbench.telemetry import run_summary

        return run_summary.table(run_summary.summaries(self.store.runs))

    @property
    def run_records(self) -> tuple[RunRecord, ...]:
        """The runs themselves: each one's Config, origin and every rank's StepMetrics."""
        return self.store.runs

    @property
    def history(self) -> list[StepMetrics]:
        """Rank 0's metrics of every step that led to the model on the ranks, across applies and reshards (the
        loss is the global batch's); a copy. A new model starts it afresh; the runs keep the earlier ones."""
        return self.store.steps(0)

    @property
    def layout_changes(self) -> list[LayoutChange]:
        """Where each layout took effect in the history of the model on the ranks."""
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
        self._run = Run(self, handle, run_id, steps, self._next_step())
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
        with self._doing("saving"):
            return Path(self.session.save(str(directory), keep, secrets.token_hex(4)))

    def load(self, path: str | Path, *, run: str | None = None) -> dict[str, Any]:
        """Load the newest checkpoint under `path` (or the one `path` names) into the current layout, whatever
        layout saved it.

        Without a model yet, the saved Config is applied first. Anything wrong with
        the checkpoint is found before the current model is touched; a damaged newest
        checkpoint is refused, naming the newest intact one (pass its path to load it). The steps from the
        checkpoint on are a new run (named `run` if given), so training again from one checkpoint keeps both
        branches.
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
        with self._doing("loading"):
            info = self.session.load(str(checkpoint_dir), checkpoints.resume_state(manifest))
        resumed = manifest["next_step"]
        # A checkpoint of this history (its step trained here) branches off it; any other starts a history.
        ours = any(m.step == resumed - 1 for m in self.history)
        self.store.start_run(self.config, resumed, continues=ours, origin=f"loaded {checkpoint_dir}", name=run,
                             predicted_memory=self._predicted_memory(self.config))
        return {"path": checkpoint_dir, "step": resumed, "saved_layout": manifest["layout"], **info}

    # -- the large run ---------------------------------------------------------------------------
    def export(self, directory: str | Path, *, config: Config | None = None, **launch: Any):
        """Write what runs the current Config without the notebook into `directory`: config.json, run.sh (torchrun),
        run.sbatch (Slurm), accelerate.yaml and the nearest torchtitan run (torchtitan.sh for torchtitan 0.3,
        torchtitan.toml for older releases); returns `wb.export.Exported`.

        Keywords go to `Launch.for_config`: gpus_per_node (8), device ("cuda"), steps, save_every, async_save, port;
        the launch trains on this Workbench's corpus (the Config carries the tokenizer).
        """
        from workbench.export import export

        cfg = config or self.config
        if cfg is None:
            raise RuntimeError("nothing to export: call bench.apply(wb.Config(...)) first, or pass config=")
        if self.corpus is not None:
            launch.setdefault("corpus", str(self.corpus))
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
        last = self.store.steps(0)[-1:]
        return status_line(self.cluster, self.cluster.dilation or (last[0].dilation if last else None))

    def dashboard(self, refresh_s: float = 0.3):
        """Controls and live plots in one widget: change the layout, train, watch what it does."""
        from workbench.ui.dashboard import dashboard

        return dashboard(self, refresh_s)

    def report(self, path: str | Path = "run.html") -> Path:
        """Write every run of this session (a summary line each, its Config, the plots overlaying them) as one
        self-contained HTML file."""
        from workbench.ui.report import report

        return report(self, path)

    def restart(self) -> None:
        """Restart every rank (after a failure); the model is rebuilt in the current layout, untrained.

        Load a checkpoint afterwards to continue where training was. Fresh CPU ranks are forked from the pool's
        zygote (GPU ranks come from its warm standby): about half a second here; `train(recover=True)` does all of
        it by itself.
        """
        with self._doing("spawning"):
            self.pool.restart()
        self._capabilities = self.session.capabilities()
        if self.cluster is not None:
            self._emulate()  # fresh ranks run on their own links until told
        if self.config is not None:
            self._apply(self.config, fresh=True, origin="ranks restarted")

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """End every rank (of a pool this Workbench started); the model on them is gone (save first to keep it).

        Its dashboards stop updating and say so; the runs stay readable (`bench.runs`, `bench.report()`).
        """
        if self.closed:
            return
        self.closed = True
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
        state = ", closed" if self.closed else ""
        emulated = f", cluster={self.cluster.describe()}" if self.cluster is not None else ""
        return f"Workbench({self.pool!r}, layout={layout}, steps={len(self.history)}{emulated}{state})"


def keeps_weights(current: Config | None, new: Config, fresh: bool) -> bool:
    """Whether applying `new` on top of `current` reshards the trained model (else it builds a new one):
    the rule the ranks' session applies (same shape and seed, routing settings aside, and not `fresh`)."""
    return (current is not None and not fresh and current.model.same_weights(new.model)
            and current.seed == new.seed)
