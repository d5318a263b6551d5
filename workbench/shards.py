"""The data cache: a corpus built once into a shard of tokens on disk, memory-mapped by every rank.

Building a shard needs no torch (numpy and a file lock), so the notebook can build one before its ranks map it,
and data/prepare.py can build one ahead; `workbench.engine.data` makes the batches a rank trains on from it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from workbench.corpus import Corpus, is_text

SEPARATOR = 0
"""Byte written after every file. Text never contains NUL (files that do are skipped as binary), so it marks a file
boundary unambiguously."""
SHARD_FORMAT = 1
"""Bumped when the shard's layout changes, so older caches are rebuilt rather than misread."""


@dataclass(frozen=True)
class Manifest:
    """What a shard holds; stored as JSON beside it."""

    source: str
    files: int
    bytes: int
    sha256: str
    """Hash of the shard's bytes: ranks on different machines can compare it to be sure they train on the same text."""
    fingerprint: str
    skipped: int
    """Files left out because they contain NUL bytes (binary)."""
    separator: int
    format: int
    created: str


@dataclass(frozen=True)
class Shard:
    """A built corpus: the uint8 file and its manifest."""

    path: Path
    manifest: Manifest

    def tokens(self) -> np.memmap:
        """The bytes, memory-mapped read-only: ranks share the page cache instead of each holding a copy."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")


def default_cache_dir() -> Path:
    """$WORKBENCH_DATA_CACHE, else data/cache in the checkout when writable, else ~/.cache/workbench/data."""
    if env := os.environ.get("WORKBENCH_DATA_CACHE"):
        return Path(env).expanduser()
    data_dir = Path(__file__).resolve().parents[1] / "data"
    # prepare.py marks a checkout; an installed package has no data/ folder beside it.
    if (data_dir / "prepare.py").is_file():
        cache = data_dir / "cache"
        if os.access(cache if cache.exists() else data_dir, os.W_OK):
            return cache
    return Path.home() / ".cache" / "workbench" / "data"


def prepare(corpus: str | Path | None = None, cache_dir: str | Path | None = None) -> Shard:
    """The shard for `corpus`, built on first use and rebuilt when the folder changes.

    Safe when several ranks call it at once: one builds under a file lock while
    the others wait, and files only appear by atomic rename, so nobody ever
    maps a half-written shard.
    """
    source = Corpus.resolve(corpus)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    files = source.files()
    fingerprint = source.fingerprint(files)
    base = cache / source.cache_key()
    shard = _load_if_current(base, fingerprint)
    if shard is not None:
        return shard
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(_beside(base, ".lock"))):
        # Another rank may have built it while this one waited for the lock.
        shard = _load_if_current(base, fingerprint)
        if shard is None:
            shard = _build(source, files, fingerprint, base)
    return shard


def prepare_default_corpus() -> str:
    """Build (or find) the standard library's shard in the default cache; one line saying what it holds."""
    shard = prepare()
    m = shard.manifest
    return f"{m.source}: {m.files} files, {m.bytes:,} bytes -> {shard.path}"


def _load_if_current(base: Path, fingerprint: str) -> Shard | None:
    manifest_path, bin_path = _beside(base, ".json"), _beside(base, ".bin")
    try:
        manifest = Manifest(**json.loads(manifest_path.read_text()))
        size = bin_path.stat().st_size
    except (OSError, ValueError, TypeError):
        return None
    if manifest.format != SHARD_FORMAT or manifest.fingerprint != fingerprint or manifest.bytes != size:
        return None
    return Shard(bin_path, manifest)


def _build(source: Corpus, files: list[Path], fingerprint: str, base: Path) -> Shard:
    digest, total, kept, skipped = hashlib.sha256(), 0, 0, 0
    tmp = tempfile.NamedTemporaryFile(dir=base.parent, prefix=base.name, suffix=".bin.tmp", delete=False)
    try:
        with tmp:
            for path in files:
                text = path.read_bytes()
                if not is_text(text):
                    skipped += 1
                    continue
                for piece in (text, bytes([SEPARATOR])):
                    tmp.write(piece)
                    digest.update(piece)
                    total += len(piece)
                kept += 1
        if kept == 0:
            what = f"no *{source.suffix} files" if source.suffix else "no text files"
            raise ValueError(f"corpus {source.root} has {what}"
                             + (f" ({skipped} binary files skipped)" if skipped else "")
                             + "; point it at a folder holding text")
        manifest = Manifest(source=str(source.root), files=kept, bytes=total, sha256=digest.hexdigest(),
                            fingerprint=fingerprint, skipped=skipped, separator=SEPARATOR, format=SHARD_FORMAT,
                            created=datetime.datetime.now(datetime.UTC).isoformat())
        _publish(tmp.name, _beside(base, ".bin"))
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    # The manifest lands last: a reader that finds it current also finds the matching .bin.
    _write_atomic(_beside(base, ".json"), json.dumps(asdict(manifest), indent=2) + "\n")
    return Shard(_beside(base, ".bin"), manifest)


def _beside(base: Path, suffix: str) -> Path:
    # Not with_suffix: the key's own dots ("stdlib-python3.11-…") would be taken for a suffix.
    return base.parent / (base.name + suffix)


def _write_atomic(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        tmp.write(text)
    _publish(tmp.name, path)


def _publish(tmp: str, path: Path) -> None:
    # Temporary files are created 0600; the shard is read-only data that other users' ranks may share.
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
