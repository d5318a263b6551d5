"""The content-addressed chunk store under a checkpoint root: each chunk a file named by the SHA-256 of its bytes.

What makes a checkpoint cheap when little changed (Megatron's "differential
snapshots", done by content rather than by diff): a save cuts every tensor
shard into chunks (`cut`), names each by its digest, and writes only those the
store does not hold yet; a frozen embedding or an unchanged step costs an index
and a manifest. Chunks are cut along tensor boundaries, never across them, so an
unchanged tensor gives the same chunks whatever changed beside it: a tensor of
at least `SMALL_BYTES` has chunks of its own (pieces of `CHUNK_BYTES`); smaller
ones (norms, step counters, RNG states) are packed together up to `CHUNK_BYTES`,
so a checkpoint is a few files, not thousands of tiny ones.

Safety: a chunk appears under its name only complete and fsynced (written to a
temporary name, then renamed); a commit first checks every chunk it names is
there; garbage collection (`collect`) runs only under the root's lock, after a
commit, and deletes only chunks that no checkpoint directory's manifest names.
Sharing has a cost too: one corrupt chunk breaks every checkpoint holding it;
`verify` names it and they are refused, never loaded wrong.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from workbench.checkpoints.layout import CheckpointError, finals, sha256_file

CHUNKS = "chunks"
LOCK = ".lock"
CHUNK_BYTES = 4 << 20
"""Largest chunk: big tensors are cut into pieces of this size; small ones packed up to it."""
SMALL_BYTES = 64 << 10
"""Tensor shards smaller than this share packed chunks with their neighbours; larger ones get their own."""
_TEMP_PREFIX = ".tmp-"


def chunk_path(root: str | Path, digest: str) -> Path:
    """Where the chunk with SHA-256 `digest` lives: fanned out by its first two hex digits."""
    return Path(root) / CHUNKS / digest[:2] / digest


def digests(directory: str | Path, names: list[str]) -> dict[str, str]:
    """SHA-256 of the named files in `directory`."""
    return {name: sha256_file(Path(directory) / name) for name in names}


# -- cutting -------------------------------------------------------------------------------------------------
def cut(sizes: list[int]) -> list[list[tuple[int, int, int]]]:
    """How items of these byte sizes (in save order) become chunks: each chunk a list of (item, offset in the item,
    length), its bytes their concatenation. A pure function of the sizes, so the same tensors cut the same way."""
    chunks: list[list[tuple[int, int, int]]] = []
    pack: list[tuple[int, int, int]] = []
    packed = 0
    for item, size in enumerate(sizes):
        if size >= SMALL_BYTES:
            if pack:
                chunks.append(pack)
                pack, packed = [], 0
            chunks.extend([(item, offset, min(CHUNK_BYTES, size - offset))] for offset in range(0, size, CHUNK_BYTES))
            continue
        if pack and packed + size > CHUNK_BYTES:
            chunks.append(pack)
            pack, packed = [], 0
        pack.append((item, 0, size))
        packed += size
    if pack:
        chunks.append(pack)
    return chunks


# -- writing (every rank, for its own chunks) -------------------------------------------------------------------
def put(root: str | Path, data: bytes | memoryview) -> tuple[str, bool]:
    """Store `data` as a chunk; returns its digest and whether it had to be written (False: the store had it)."""
    digest = hashlib.sha256(data).hexdigest()
    path = chunk_path(root, digest)
    try:
        if path.stat().st_size == len(data):
            return digest, False
    except FileNotFoundError:
        pass
    # Missing, or truncated by damage: written whole under a temporary name, then renamed over it.
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f"{_TEMP_PREFIX}{digest[:16]}-{secrets.token_hex(4)}"
    write_synced(temp, data)
    os.replace(temp, path)
    return digest, True


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and wait until it is on the disk."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_directory(directory: Path) -> None:
    """Make the names in `directory` durable (a file renamed into it is on the disk only once this returns)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync(root: str | Path, used: set[str]) -> None:
    """Make the names of the chunks in `used` durable (their directories fsynced), reused ones included: an
    interrupted save may have renamed a chunk into place without syncing its directory."""
    store = Path(root) / CHUNKS
    for directory in sorted({chunk_path(root, d).parent for d in used}) + [store, Path(root)]:
        if directory.exists():
            fsync_directory(directory)


# -- checking (the notebook, and rank 0 before a commit) ----------------------------------------------------------
def missing(root: str | Path, chunks: dict[str, int]) -> list[str]:
    """The chunks of `chunks` (digest → size) that are not in the store with their size; cheap (one stat each)."""
    gone = []
    for digest, size in chunks.items():
        try:
            if chunk_path(root, digest).stat().st_size != size:
                gone.append(digest)
        except OSError:
            gone.append(digest)
    return gone


def first_bad(root: str | Path, chunks: dict[str, int]) -> tuple[str, str] | None:
    """The first chunk of `chunks` whose bytes do not match its name and size, and what is wrong; None if all do."""
    for digest, size in sorted(chunks.items()):
        path = chunk_path(root, digest)
        try:
            found_size = path.stat().st_size
            found = sha256_file(path) if found_size == size else None
        except OSError:
            return digest, f"{path}: missing (a chunk this checkpoint's manifest names)"
        if found is None:
            return digest, (f"{path}: {found_size} bytes, the manifest says {size}: the chunk is truncated or was "
                            "changed after the save")
        if found != digest:
            return digest, (f"{path}: SHA-256 {found[:16]}… does not match its name: the chunk is corrupt or was "
                            "changed after the save")
    return None


def holders(root: str | Path, digest: str) -> list[str]:
    """The checkpoints under `root` whose manifests name the chunk `digest` (a bad chunk breaks all of them)."""
    out = []
    for _, directory in finals(Path(root)):
        try:
            if digest in json.loads((directory / "manifest.json").read_bytes()).get("chunks", {}):
                out.append(directory.name)
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return out


# -- garbage collection (rank 0, under the lock, after a commit) ----------------------------------------------------
def referenced(root: str | Path) -> set[str]:
    """Every chunk named by the manifest of any `step-N` directory under `root`, intact or not: a damaged
    checkpoint whose manifest still reads keeps its chunks (it may be repaired; nothing is lost by waiting)."""
    live: set[str] = set()
    for _, directory in finals(Path(root)):
        try:
            chunks = json.loads((directory / "manifest.json").read_bytes()).get("chunks")
        except (OSError, ValueError, AttributeError):
            continue  # no readable manifest: nothing of it can ever load
        if isinstance(chunks, dict):
            live.update(d for d in chunks if isinstance(d, str))
    return live


def collect(root: str | Path) -> tuple[int, int]:
    """Delete every chunk no checkpoint names, and leftovers of interrupted chunk writes; (chunks, bytes) freed.

    Only the holder of the root's lock may call this: a save in progress names
    its chunks in no manifest yet, and the lock keeps it from running meanwhile.
    """
    store = Path(root) / CHUNKS
    if not store.is_dir():
        return 0, 0
    live = referenced(root)
    count = freed = 0
    for fan in store.iterdir():
        if not fan.is_dir():
            continue
        for chunk in fan.iterdir():
            if chunk.name in live and chunk.name.startswith(fan.name):
                continue
            with contextlib.suppress(OSError):
                size = chunk.stat().st_size
                if chunk.is_dir():
                    shutil.rmtree(chunk)
                else:
                    chunk.unlink()
                count, freed = count + 1, freed + size
        with contextlib.suppress(OSError):
            fan.rmdir()  # only if empty
    return count, freed


@contextlib.contextmanager
def lock(root: str | Path) -> Iterator[None]:
    """Hold the root's write lock (flock; released if the process dies): one save at a time writes and collects."""
    path = Path(root) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{root}: another save is writing there now (it holds {path}); wait for it or save "
                                  "to another directory") from None
        yield
    finally:
        os.close(fd)  # releases the lock
