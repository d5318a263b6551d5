"""Which checkpoint a load takes, and the check of every byte of it before any rank reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.checkpoints import store
from workbench.checkpoints.layout import COMMIT, MANIFEST, METADATA, STALE, CheckpointError, finals, is_committed, \
    sha256_file
from workbench.checkpoints.manifest import read_manifest


def resolve(path: str | Path) -> Path:
    """The checkpoint `path` names: itself if it is one, else the newest inside it, if that one is intact.

    Never a silent fallback: when the newest checkpoint under `path` is damaged
    (commit marker missing or wrong, manifest unreadable or out of schema, a
    file or chunk gone), this refuses, naming it and the newest intact one;
    loading an older checkpoint takes naming it (`ckpt/step-000110`).
    """
    path = Path(path).expanduser().absolute()  # ranks may run elsewhere: they get an absolute path
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory (e.g. ckpt/ or ckpt/step-000120)")
    if any((path / name).exists() for name in (COMMIT, MANIFEST, METADATA)):
        if not is_committed(path):
            raise CheckpointError(f"{path} is incomplete (no valid commit marker: the save was interrupted or the "
                                  f"files were changed); load {path.parent} to take the latest complete checkpoint")
        return path
    found = finals(path)
    if not found:
        partial = sorted(c.name for c in path.iterdir() if STALE.match(c.name))
        detail = f" (incomplete, not loadable: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {path}{detail}")
    newest_step, newest = found[-1]
    problem = damage(newest)
    if problem is None:
        return newest
    intact = next(((s, d) for s, d in reversed(found[:-1]) if damage(d) is None), None)
    if intact is None:
        older = "; no older checkpoint there is intact either"
    else:
        step, directory = intact
        older = (f"; the newest intact one is {directory} (step {step}, {newest_step - step} steps earlier): to "
                 f"continue from there, load it by name: bench.load({str(directory)!r})")
    raise CheckpointError(f"{newest}, the newest checkpoint in {path}, is damaged ({problem}); nothing was "
                          f"loaded{older}")


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a finished checkpoint, found without reading its data: commit marker, manifest schema,
    every file and chunk present with its size; None if nothing is. `verify` checks the digests when it loads."""
    if not (checkpoint / COMMIT).is_file():
        return f"its commit marker {COMMIT} is missing"
    if not is_committed(checkpoint):
        return f"{MANIFEST} does not match the commit marker (unreadable, truncated or edited)"
    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError as e:
        return str(e).removeprefix(f"{checkpoint}: ")
    absent = [name for name in manifest["files"] if not (checkpoint / name).is_file()]
    if absent:
        return f"{absent[0]} is missing"
    gone = store.missing(checkpoint.parent, manifest["chunks"])
    return f"{len(gone)} of its chunks are missing or truncated (first: {gone[0][:16]}…)" if gone else None


def verify(checkpoint: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint, after checking its index and every chunk against their SHA-256."""
    if not is_committed(checkpoint):
        raise CheckpointError(f"{checkpoint / MANIFEST}: does not match the commit marker {checkpoint / COMMIT}")
    manifest = read_manifest(checkpoint)
    for name, expected in sorted(manifest["files"].items()):  # plain names inside the checkpoint: the schema says so
        if not (checkpoint / name).is_file():
            raise CheckpointError(f"{checkpoint / name}: missing (listed in the manifest)")
        found = sha256_file(checkpoint / name)
        if found != expected:
            raise CheckpointError(f"{checkpoint / name}: SHA-256 {found[:16]}… does not match the manifest's "
                                  f"{expected[:16]}…: the file is corrupt or was changed after the save")
    extra = sorted(p.name for p in checkpoint.iterdir() if p.name not in manifest["files"] and p.name not in
                   (MANIFEST, COMMIT))
    if extra:
        raise CheckpointError(f"{checkpoint}: files not in the manifest: {extra}")
    bad = store.first_bad(checkpoint.parent, manifest["chunks"])
    if bad is not None:
        digest, problem = bad
        shared = store.holders(checkpoint.parent, digest)
        raise CheckpointError(f"{problem}; checkpoints that read it: {', '.join(shared)}")
    return manifest
