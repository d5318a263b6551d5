"""Saving and loading from the notebook: what is checked before any rank is touched, the commands the ranks run,
and the run a load starts. The format and its files are `workbench.checkpoints`; the ranks' side is
`workbench.engine.checkpoint`.

    bench.save("ckpt/", keep=3)      # ckpt/step-N
    bench.load("ckpt/")              # the newest intact one, into whatever layout the ranks hold now
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench import checkpoints
from workbench.compare import predicted_memory_on

if TYPE_CHECKING:
    from workbench.workbench import Workbench


def save(bench: "Workbench", path: str | Path, keep: int | None) -> Path:
    """Save the model on `bench`'s ranks as `path`/step-N, keeping the `keep` latest; returns its directory."""
    checkpoints.check_options(keep=keep)
    if bench.config is None:
        raise RuntimeError("nothing to save: call bench.apply(wb.Config(...)) first")
    bench._require_idle("save")
    directory = checkpoints.writable_directory(path)
    # The nonce names the save's temporary directory, the same on every rank.
    with bench._doing("saving"):
        return Path(bench.session.save(str(directory), keep, secrets.token_hex(4)))


def load(bench: "Workbench", path: str | Path, run: str | None) -> dict[str, Any]:
    """Load the newest checkpoint under `path` (or the one it names) into `bench`'s current layout, applying the
    saved Config first when there is no model yet; the steps from it on are a new run (named `run`)."""
    bench._require_idle("load a checkpoint")
    checkpoint_dir = checkpoints.resolve(path)
    manifest = checkpoints.verify(checkpoint_dir)
    if bench.config is None:
        saved = checkpoints.config_from_json(manifest["config"])
        if saved.world_size != bench.pool.world_size:
            raise checkpoints.CheckpointError(
                f"{checkpoint_dir} was saved by {manifest['layout']} ({saved.world_size} ranks); this Workbench "
                f"has {bench.pool.world_size}: call bench.apply(cfg) with a layout for these ranks first, then load")
        bench.apply(saved)
    with bench._doing("loading"):
        info = bench.session.load(str(checkpoint_dir), checkpoints.resume_state(manifest))
    resumed = manifest["next_step"]
    # A checkpoint of this history (its step trained here) branches off it; any other starts a history.
    ours = any(m.step == resumed - 1 for m in bench.history)
    bench.store.start_run(bench.config, resumed, continues=ours, origin=f"loaded {checkpoint_dir}", name=run,
                          predicted_memory=predicted_memory_on(bench.config, bench.capabilities))
    return {"path": checkpoint_dir, "step": resumed, "saved_layout": manifest["layout"], **info}
