"""What a save leaves on disk, without ranks or torch: the helpers the checkpoint format tests share."""

from __future__ import annotations

import json
from pathlib import Path

from workbench import checkpoints as ck
from workbench.checkpoints import store
from workbench.config import Config

CFG = Config(dp=2)


def manifest(step: int, files: dict[str, str], chunks: dict[str, int]) -> dict:
    """A manifest as a save writes it (engine/checkpoint.py), for `step`."""
    return {"files": files, "chunks": chunks, "next_step": step, "steps_done": step, "skipped_steps": 0,
            "scaler": None, "config": ck.config_to_json(CFG), "layout": CFG.layout, "world_size": 2,
            "torch": "2.13.0"}


def put_all(root: Path, payloads: list[bytes]) -> dict[str, int]:
    """Each payload as a chunk in the store, as ranks write them; digest → size."""
    return {store.put(root, p)[0]: len(p) for p in payloads}


def save(root: Path, step: int, payloads: list[bytes] = (b"shard", b"drahs"), *, keep: int | None = None,
         nonce: str = "ab12") -> Path:
    """A save: chunks into the store, the index into the temporary directory, then the commit, under the lock."""
    root.mkdir(parents=True, exist_ok=True)
    with store.lock(root):
        chunks = put_all(root, list(payloads))
        tmp = ck.temp_dir(root, step, nonce)
        tmp.mkdir()
        (tmp / ".metadata").write_bytes(b"index of step %d" % step)
        return ck.commit(tmp, ck.final_dir(root, step), manifest(step, ck.digests(tmp, [".metadata"]), chunks),
                         keep)


def rewrite(checkpoint: Path, remark: bool = True, **fields) -> None:
    """Edit manifest fields, and re-mark the commit as a forger would (or leave the marker stale)."""
    path = checkpoint / ck.MANIFEST
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))
    if remark:
        (checkpoint / ck.COMMIT).write_text(ck.sha256_file(path))


def checkpoints_in(root: Path) -> list[str]:
    """The checkpoint directories under `root` (the store and its lock file aside)."""
    return sorted(p.name for p in root.iterdir() if p.name not in (store.CHUNKS, store.LOCK))


def chunk_files(root: Path) -> set[str]:
    return {p.name for p in (root / store.CHUNKS).glob("*/*")}
