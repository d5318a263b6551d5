"""The notebook's one narrow interface to the model on the ranks: the pool a Workbench starts (its ranks preload the
engine's session, and record every collective when asked), and `RankSession`, a method per command of
`workbench.engine.session`, sent by name so that the notebook never imports torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench import checkpoints
from workbench.config import Config
from workbench.pool import Handle, Pool, RemoteError


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


def start_pool(world_size: int, *, recording: bool, **pool_kwargs: Any) -> Pool:
    """The pool of a Workbench: `world_size` ranks with the engine's session loaded, every collective recorded when
    `recording` (telemetry, or an emulated cluster's pacing); `pool_kwargs` go to `Pool`."""
    setup = RECORDING_BACKEND if recording else None
    if setup:  # the ranks' flight rings, read while they hang, become the hang report's summary line
        from workbench.telemetry.flight import explain_diagnostics

        pool_kwargs.setdefault("explain", explain_diagnostics)
    return Pool(world_size, preload=(SESSION_MODULE,), backend_setup=setup, **pool_kwargs)


class _OnRanks:
    """A function of `workbench.engine.session`, sent by name: importing that module here, to send the function
    itself, would bring torch and torch.distributed into the notebook (about 3 s of its start, for nothing it
    uses)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__qualname__ = name  # what the pool's reports call the command, as they would the function

    def __repr__(self) -> str:
        return f"workbench.engine.session.{self.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from workbench.engine import session

        return getattr(session, self.name)(*args, **kwargs)


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
        return self.pool.run(_OnRanks("capabilities"))[0]

    def observe_steps(self, observer: Any) -> None:
        """Have every rank's session call `observer(metrics, cfg)` after each step (`engine.session.observe_steps`)."""
        self.pool.run(_OnRanks("observe_steps"), observer)

    def apply(self, cfg: Config, corpus: str | Path | None, telemetry: bool, fresh: bool,
              flops_per_token: float | None = None) -> dict[str, Any]:
        return self.pool.run(_OnRanks("apply"), cfg, corpus, telemetry, fresh, flops_per_token)[0]

    def train(self, steps: int, run_id: str, saves: checkpoints.SaveSchedule | None) -> Handle:
        return self.pool.run_async(_OnRanks("train"), steps, run_id, saves)

    def export_hf(self, directory: str, max_shard_bytes: int) -> list[str]:
        return self.pool.run(_OnRanks("export_hf"), directory, max_shard_bytes)[0]

    def snapshot(self) -> list[dict[str, Any]]:
        """Every rank's part of the training state, for the notebook to hold (`workbench.recovery`)."""
        return self.pool.run(_OnRanks("snapshot"))

    def restore(self, snapshot: list[dict[str, Any]]) -> int:
        return self.pool.run(_OnRanks("restore"), snapshot)[0]

    def save(self, directory: str, keep: int | None, nonce: str) -> str:
        return self._checkpoint_command(_OnRanks("save"), directory, keep, nonce)

    def load(self, path: str, saved: dict[str, Any]) -> dict[str, Any]:
        return self._checkpoint_command(_OnRanks("load"), path, saved)

    def _checkpoint_command(self, fn: Any, *args: Any) -> Any:
        """Run a checkpoint command on every rank; a CheckpointError raised there is raised here as itself."""
        try:
            return self.pool.run(fn, *args)[0]
        except RemoteError as e:
            if e.exc_type == "CheckpointError":
                raise checkpoints.CheckpointError(e.remote_message) from e
            raise
