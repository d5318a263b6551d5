"""Byte-level training data: a folder of text as one cached shard, and batches that are a pure function of (seed, step).

Tokens are bytes (vocabulary 256), so nothing is downloaded: the default
corpus is the Python standard library's own source, which every install has.
The corpus is concatenated once into a uint8 file under the cache directory
and memory-mapped by every rank. A batch depends only on (seed, step) and not
on the parallel layout, so every layout sees the same data, and resuming at
step k replays exactly what an uninterrupted run would have seen.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from filelock import FileLock

from workbench.config import Config
from workbench.corpus import Corpus, is_text

if TYPE_CHECKING:
    import torch

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
    data_dir = Path(__file__).resolve().parents[2] / "data"
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


class TokenData:
    """Training and validation batches of byte tokens over one corpus.

    `global_batch(step)` is a pure function of (seed, step): random windows of
    seq_len + 1 bytes from the training split (the first 1 - val_fraction of
    the corpus). `local_batch` hands a data-parallel rank its contiguous rows of
    that global batch, so every layout trains on the same examples. Validation
    batches tile the held-out tail in order.
    """

    def __init__(self, corpus: str | Path | None = None, *, batch_size: int, seq_len: int, seed: int = 0,
                 val_fraction: float = 0.05, cache_dir: str | Path | None = None) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        self.batch_size, self.seq_len, self.seed, self.val_fraction = batch_size, seq_len, seed, val_fraction
        self.shard = prepare(corpus, cache_dir)
        self._tokens = self.shard.tokens()
        total = len(self._tokens)
        self.train_bytes = total - round(total * val_fraction)
        """Training windows lie in [0, train_bytes); validation windows in [train_bytes, end)."""
        self.num_val_batches = (total - self.train_bytes - 1) // seq_len // batch_size
        window = seq_len + 1
        if self.train_bytes < window or self.num_val_batches == 0:
            need = max(window, batch_size * seq_len + 1)
            raise ValueError(f"corpus {self.shard.manifest.source} has {total} bytes: too few for seq_len={seq_len} "
                             f"and batch_size={batch_size} (its {val_fraction:.0%} validation split needs at least "
                             f"{need} bytes); use a larger folder or a smaller batch")

    @classmethod
    def for_config(cls, cfg: Config, corpus: str | Path | None = None, **kwargs) -> TokenData:
        """The data a `Config` trains on: its batch_size, seq_len and seed."""
        return cls(corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, **kwargs)

    def offsets(self, step: int) -> np.ndarray:
        """Where each window of the global batch at `step` starts: drawn from a generator seeded by (seed, step)."""
        if step < 0:
            raise ValueError(f"step must be ≥ 0, got {step}")
        # SeedSequence mixes the pair into independent streams; % 2**64 admits negative seeds.
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed % 2**64, step])))
        return rng.integers(0, self.train_bytes - self.seq_len, size=self.batch_size, dtype=np.int64)

    def global_batch(self, step: int) -> torch.Tensor:
        """(batch_size, seq_len + 1) int64 tokens: inputs are [:, :-1], targets [:, 1:]."""
        return self._windows(self.offsets(step))

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Rows [dp_rank·B/dp_size, (dp_rank+1)·B/dp_size) of `global_batch(step)`, without building the others."""
        return self._windows(self.offsets(step)[self._rows(dp_rank, dp_size)])

    def val_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> torch.Tensor:
        """Validation batch i of `num_val_batches` (or this dp rank's rows of it): consecutive held-out windows."""
        if not 0 <= i < self.num_val_batches:
            raise IndexError(f"validation batch {i} out of range: there are {self.num_val_batches}")
        first = self.train_bytes + i * self.batch_size * self.seq_len
        offsets = first + self.seq_len * np.arange(self.batch_size, dtype=np.int64)
        return self._windows(offsets[self._rows(dp_rank, dp_size)])

    def _rows(self, dp_rank: int, dp_size: int) -> slice:
        if dp_size <= 0 or self.batch_size % dp_size:
            raise ValueError(f"batch_size={self.batch_size} does not split across dp_size={dp_size} ranks")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        rows = self.batch_size // dp_size
        return slice(dp_rank * rows, (dp_rank + 1) * rows)

    def _windows(self, offsets: np.ndarray) -> torch.Tensor:
        # Imported here, not at the top, so that building shards (data/prepare.py) never waits for torch to load.
        import torch

        index = offsets[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        return torch.from_numpy(self._tokens[index].astype(np.int64))

    def __getstate__(self) -> dict:
        # A memmap would pickle as a full copy of the corpus; ranks re-map the file instead.
        state = self.__dict__.copy()
        del state["_tokens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = self.shard.tokens()

    def __repr__(self) -> str:
        m = self.shard.manifest
        return (f"TokenData({m.source!r}: {m.files} files, {m.bytes / 1e6:.1f} MB, train {self.train_bytes} bytes, "
                f"{self.num_val_batches} val batches; batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"seed={self.seed})")
