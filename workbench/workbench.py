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
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from workbench import checkpointing, checkpoints, kernel, training
from workbench.compare import predicted_memory_on
from workbench.config import Config, ConfigError, HFModel, ModelConfig, keeps_weights
from workbench.config.support import ModelFacts, builtin_facts
from workbench.corpus import check_corpus
from workbench.emulated import Emulation
from workbench.emulation import Cluster
from workbench.machine import Machine, world_size_warning
from workbench.pool import Pool
from workbench.rank_session import RankSession, prepare_ahead, start_pool  # noqa: F401 - prepare_ahead: wb.workbench's too
from workbench.telemetry.events import StepMetrics
from workbench.telemetry.runs import LayoutChange, RunRecord
from workbench.telemetry.store import TelemetryStore
from workbench.training import Run


log = logging.getLogger(__name__)


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
        cluster = Emulation.shaped(cluster, pool.world_size if pool is not None else world_size, telemetry)
        self._prepared: tuple[str | Path | None, str | None] | None = None
        """The corpus and tokenizer whose shard the notebook last made sure of (`_prepare_data`)."""
        if pool is None:
            if not pool_kwargs.get("external") and (warning := world_size_warning(
                    world_size, Machine.this(), oversubscribe=oversubscribe)):
                warnings.warn(f"Workbench(world_size={world_size}): {warning}", stacklevel=2)
            # The ranks' start is another process's work (importing torch): this one waits, so it looks for the
            # corpus's byte shard meanwhile, which the first apply would otherwise look for before the ranks build.
            with _meanwhile(self._find_byte_shard):
                pool = start_pool(world_size, recording=telemetry or cluster is not None, **pool_kwargs)
        self.pool = pool
        self.session = RankSession(pool) if session is None else session
        """The commands this Workbench sends to the model on the ranks."""
        self.config: Config | None = None
        self.emulation = Emulation(pool, self.session, cluster, telemetry)
        """The cluster the ranks stand for, and the commands that make them (`workbench.emulated`)."""
        if cluster is not None:
            self.emulation.install(None)
        self.store = TelemetryStore()
        """Every rank's metrics and the layout changes, for plots to subscribe to."""
        self._run: Run | None = None
        self._unsubscribe = self.pool.subscribe(self.store.on_event)
        # Asked now, while the ranks are idle: later a run may hold them, and checking a config must not wait on it.
        self._capabilities = self.session.capabilities()
        kernel.made(self)
        if exclusive:
            kernel.claim(self)

    # -- configure -------------------------------------------------------------------------------
    def check(self, cfg: Config) -> None:
        """Raise ConfigError if `cfg` cannot run on this pool (touches no rank's model)."""
        if not isinstance(cfg, Config):
            raise ConfigError(f"config: expected a wb.Config, got {type(cfg).__name__}. Fix: pass wb.Config(...).")
        cfg.check_world(self.pool.world_size)
        if not isinstance(cfg.model, ModelConfig):
            from workbench.models.check import check_model  # torch here only for another model source

            check_model(cfg)  # built on the meta device: what only the model itself can refuse
        caps = self.capabilities
        cfg.check_device(caps["name"], fp16=caps["fp16"], bf16=caps["bf16"], fp8=caps.get("fp8", False),
                         cuda=caps["device"].startswith("cuda"), mx=caps.get("mx", False))
        Emulation.check(cfg, self.cluster)

    def describe_model(self, model: Any = None) -> ModelFacts:
        """What a model source is (the current Config's when None): its name, parameter count, blocks and, per
        layout choice, None where its family supports it, else why not (`workbench.config.support.ModelFacts`).
        Touches no rank: the built-in model from its shape, any other built on the meta device here; a model that
        cannot be built is refused as a ConfigError."""
        if model is None:
            if self.config is None:
                raise RuntimeError("no model yet: pass one, or call bench.apply(wb.Config(...)) first")
            model = self.config.model
        if isinstance(model, ModelConfig):
            return builtin_facts(model)  # no torch in the notebook for the built-in model
        from workbench.models.check import describe  # torch here only for another model source

        return describe(model)

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
            info = self.session.apply(cfg, self.corpus, self.telemetry, fresh, self._model_flops(cfg))
        self.emulation.applied(cfg)
        resharded = bool(info["resharded"])
        self.store.start_run(cfg, training.next_step(self) if resharded else 0, continues=resharded, origin=origin,
                             name=run, predicted_memory=predicted_memory_on(cfg, self.capabilities))
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

    def _find_byte_shard(self) -> None:
        """`_prepare_data` for the default tokenizer (bytes) when that shard is built already: a cheap look,
        never a build (the Config may name another tokenizer). What fails here is found again, and said, by
        `_prepare_data`."""
        from workbench.shards import prepare

        with contextlib.suppress(Exception):
            if prepare(self.corpus, build=False) is not None:
                self._prepared = (self.corpus, None)

    def _model_flops(self, cfg: Config) -> float | None:
        """Model FLOPs per token of a model other than the built-in one, for the ranks' measured MFU: traced once
        on fake tensors (cached; the estimate reads the same trace). None when it cannot be traced: no MFU then."""
        if isinstance(cfg.model, ModelConfig) or not self.telemetry:
            return None
        try:
            from workbench.tracing.estimate import traced_profile

            profile = traced_profile(cfg.model, cfg.seq_len)
        except Exception:  # noqa: BLE001 - a measurement aid; training goes on without it
            log.warning("could not trace %s for its model FLOPs: no MFU measured", cfg.model.name, exc_info=True)
            return None
        return profile.per_token(profile.model_flops)

    @contextlib.contextmanager
    def _doing(self, phase: str) -> Iterator[None]:
        """Say `phase` in the status line while the block runs."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

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
        training.check_steps(steps, recover, snapshot_every)
        if self.config is None:
            raise RuntimeError("no model yet: call bench.apply(wb.Config(...)) first")
        self._require_idle("start another run")
        saves = checkpoints.schedule(save_every, save_to, keep, async_save)
        self._run = training.start(self, steps, saves, recover=recover, snapshot_every=snapshot_every,
                                   max_failures=max_failures)
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
        return checkpointing.save(self, path, keep)

    def load(self, path: str | Path, *, run: str | None = None) -> dict[str, Any]:
        """Load the newest checkpoint under `path` (or the one `path` names) into the current layout, whatever
        layout saved it.

        Without a model yet, the saved Config is applied first. Anything wrong with
        the checkpoint is found before the current model is touched; a damaged newest
        checkpoint is refused, naming the newest intact one (pass its path to load it). The steps from the
        checkpoint on are a new run (named `run` if given), so training again from one checkpoint keeps both
        branches.
        """
        return checkpointing.load(self, path, run)

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

    def export_hf(self, path: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
        """Write the trained Hugging Face model (an `HFModel`) into folder `path` as transformers reads it:
        safetensors (sharded past `max_shard_bytes`, with its index) and config.json; returns the files.
        `wb.HFModel(path, weights=path)` loads it back bit for bit, in any layout."""
        self._require_idle("export the model")
        if self.config is None:
            raise RuntimeError("nothing to export: call bench.apply(wb.Config(model=wb.HFModel(...))) first")
        if not isinstance(self.config.model, HFModel):
            raise ConfigError(f"model: export_hf writes a Hugging Face checkpoint, and the model is a "
                              f"{type(self.config.model).__name__}. Fix: use bench.save(path) for a workbench "
                              "checkpoint")
        folder = Path(path).expanduser().resolve()
        return [Path(p) for p in self.session.export_hf(str(folder), max_shard_bytes)]

    def emulate(self, cluster: Cluster | str | None) -> str:
        """Stand for another cluster from now on (None: this machine's own links); returns `links`.

        The model and its training state stay as they are: only what communication costs changes.
        """
        self._require_idle("change the emulated cluster")
        self.emulation.change(cluster, self.config)
        return self.links

    @property
    def cluster(self) -> Cluster | None:
        """The emulated cluster, shaped for this pool's ranks; None when the links are this machine's own."""
        return self.emulation.cluster

    # -- see ---------------------------------------------------------------------------------------
    @property
    def links(self) -> str:
        """One line: whether a cluster is emulated, which, and the time dilation the ranks paced the last step with."""
        last = self.store.steps(0)[-1:] if self.config is not None else []
        return self.emulation.line(last[0].dilation if last else None)

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
            self.emulation.install(None)  # fresh ranks run on their own links until told; the apply tells the rest
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
        self.emulation.close(pool_closed=self._owns_pool)

    def __enter__(self) -> "Workbench":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layout = self.config.layout if self.config else "no model"
        state = ", closed" if self.closed else ""
        emulated = f", cluster={self.cluster.describe()}" if self.cluster is not None else ""
        return f"Workbench({self.pool!r}, layout={layout}, steps={len(self.history)}{emulated}{state})"


@contextlib.contextmanager
def _meanwhile(work: Callable[[], None]) -> Iterator[None]:
    """Run `work` in a thread while the body runs; it has ended when the body has."""
    thread = threading.Thread(target=work, name="workbench-meanwhile", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
