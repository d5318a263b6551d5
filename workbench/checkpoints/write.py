"""The commit of a checkpoint (rank 0, once every rank's chunks are down), and pruning afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from workbench.checkpoints import store
from workbench.checkpoints.layout import COMMIT, MANIFEST, STALE, CheckpointError, complete
from workbench.checkpoints.manifest import FORMAT, check_manifest


def commit(tmp: Path, final: Path, manifest: dict[str, Any], keep: int | None = None) -> Path:
    """Write the manifest and the commit marker into `tmp`, then rename it to `final`; prune to `keep`.

    `manifest["files"]` must already hold the digest of every file in `tmp` and
    `manifest["chunks"]` every chunk the checkpoint reads. Each write is fsynced
    before the next step depends on it, so after a crash the disk never holds a
    COMMIT whose manifest, index or chunks did not reach it. The caller holds the
    root's lock (`store.lock`), so nothing collects chunks meanwhile.
    """
    unlisted = sorted(p.name for p in tmp.iterdir() if p.name not in manifest["files"] and p.name not in (MANIFEST,
                                                                                                         COMMIT))
    if unlisted:
        raise CheckpointError(f"{tmp}: files without a digest: {unlisted}")
    gone = store.missing(final.parent, manifest["chunks"])
    if gone:
        raise CheckpointError(f"{final}: {len(gone)} chunk(s) it needs are not in the store (first: "
                              f"{store.chunk_path(final.parent, gone[0])}); not committed")
    manifest = {"format": FORMAT, **manifest}
    check_manifest(manifest, final)  # what a load would refuse is never committed
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    _write_synced(tmp / MANIFEST, data)
    _write_synced(tmp / COMMIT, hashlib.sha256(data).hexdigest().encode())
    store.fsync_directory(tmp)
    aside = None
    if final.exists():  # the same step saved again: the new one replaces it
        aside = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}")
        os.rename(final, aside)
    os.rename(tmp, final)
    store.fsync_directory(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    prune(final.parent, keep)
    return final


def prune(root: Path, keep: int | None) -> None:
    """Delete leftovers of interrupted saves, all but the `keep` latest checkpoints (with `keep`), then every chunk
    no remaining checkpoint names. The caller holds the root's lock."""
    for child in root.iterdir():
        if STALE.match(child.name):
            shutil.rmtree(child, ignore_errors=True)
    if keep is not None:
        for _, old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    store.collect(root)


_write_synced = store.write_synced
"""The manifest's and the commit marker's writes (a name of this module's: fault drills replace it to crash
between them)."""
