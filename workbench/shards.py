"""The data cache: a corpus built once into a shard of tokens on disk, memory-mapped by every rank.

Building a shard needs no torch (numpy and a file lock), so the notebook can build one before its ranks map it,
and data/prepare.py can build one ahead; `workbench.engine.data` makes the batches a rank trains on from it.
Finding that the shard is current needs no numpy either: a notebook's first apply checks it without paying numpy's
import (~0.07 s), which only a build, or a rank mapping the ids, imports.
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

from filelock import FileLock

from workbench.config.tokenizer import tokenizer_info
from workbench.corpus import Corpus
from workbench.documents import documents

if TYPE_CHECKING:
    import numpy as np

    from workbench.tokens import ByteEncoder, TokenizerEncoder

SHARD_FORMAT = 1
"""Bumped when the shard's layout changes, so older caches are rebuilt rather than misread."""
BATCH_TEXT = 4 * 2**20
"""Documents are encoded in batches of about this much text (the tokenizer's threads share a batch)."""


@dataclass(frozen=True)
class Manifest:
    """What a shard holds; stored as JSON beside it. The fields after `created` came with tokenizers: a manifest
    written before them reads as a byte shard."""

    source: str
    files: int
    """Files with at least one document kept."""
    bytes: int
    """Size of the shard file (for bytes, its token count)."""
    sha256: str
    """Hash of the shard's bytes: ranks on different machines can compare it to be sure they train on the same text."""
    fingerprint: str
    skipped: int
    """Files (or records) left out because they contain NUL bytes (binary)."""
    separator: int | None
    """The token written after every document (NUL for bytes, the tokenizer's end of text), or None."""
    format: int
    created: str
    tokenizer: str | None = None
    """The tokenizer.json the ids come from; None: bytes."""
    tokenizer_sha256: str | None = None
    dtype: str = "uint8"
    """numpy dtype of one token in the file."""
    documents: int | None = None
    """Documents kept (a text file is one, a JSONL record or Parquet row one each)."""

    @property
    def tokens(self) -> int:
        import numpy as np

        return self.bytes // np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Shard:
    """A built corpus: the file of token ids and its manifest."""

    path: Path
    manifest: Manifest

    def tokens(self) -> np.memmap:
        """The ids, memory-mapped read-only: ranks share the page cache instead of each holding a copy."""
        import numpy as np

        return np.memmap(self.path, dtype=np.dtype(self.manifest.dtype), mode="r")


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


def prepare(corpus: str | Path | None = None, cache_dir: str | Path | None = None, *,
            tokenizer: str | Path | None = None, progress: bool = False, build: bool = True) -> Shard | None:
    """The shard of `corpus` in `tokenizer`'s ids (None: bytes), built on first use and rebuilt when the folder
    or the tokenizer changes. progress: show a bar while building (a widget in a notebook; tqdm's, when installed).
    build=False: only find it, None when none is built and current.

    Safe when several ranks call it at once: one builds under a file lock while
    the others wait, and files only appear by atomic rename, so nobody ever
    maps a half-written shard.
    """
    source = Corpus.resolve(corpus)
    info = tokenizer_info(tokenizer) if tokenizer is not None else None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    files = source.files()
    fingerprint = source.fingerprint(files)
    key = source.cache_key()
    if info is not None:  # the byte shard keeps its name and fingerprint: caches built before tokenizers stay valid
        fingerprint = hashlib.sha256(f"{fingerprint}|{info.sha256}".encode()).hexdigest()
        key = f"{key}-tok{info.sha256[:12]}"
    base = cache / key
    shard = _load_if_current(base, fingerprint)
    if shard is not None or not build:
        return shard
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(_beside(base, ".lock"))):
        # Another rank may have built it while this one waited for the lock.
        shard = _load_if_current(base, fingerprint)
        if shard is None:
            from workbench.tokens import encoder_for

            shard = _build(source, files, fingerprint, base, encoder_for(info), progress)
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


class _Writer:
    """The shard's temporary file, its hash, and what it counted."""

    def __init__(self, file) -> None:
        self.file, self.digest = file, hashlib.sha256()
        self.bytes = self.documents = self.skipped = 0

    def write(self, encoded: list[np.ndarray | None]) -> int:
        """Append each document's ids; returns how many were kept."""
        kept = 0
        for ids in encoded:
            if ids is None:
                self.skipped += 1
                continue
            data = ids.tobytes()
            self.file.write(data)
            self.digest.update(data)
            self.bytes += len(data)
            kept += 1
        self.documents += kept
        return kept


def _build(source: Corpus, files: list[Path], fingerprint: str, base: Path, encoder: ByteEncoder | TokenizerEncoder,
           progress: bool) -> Shard:
    tmp = tempfile.NamedTemporaryFile(dir=base.parent, prefix=base.name, suffix=".bin.tmp", delete=False)
    bar = _progress_bar(source, files, encoder) if progress else None
    kept_files = 0
    try:
        with tmp:
            out = _Writer(tmp)
            for path in files:
                kept_files += _encode_file(path, encoder, out, bar) > 0
        if out.documents == 0:
            what = f"no *{source.suffix} files" if source.suffix else "no text files"
            raise ValueError(f"corpus {source.root} has {what}"
                             + (f" ({out.skipped} binary files skipped)" if out.skipped else "")
                             + "; point it at a folder holding text")
        info = getattr(encoder, "info", None)
        manifest = Manifest(source=str(source.root), files=kept_files, bytes=out.bytes, sha256=out.digest.hexdigest(),
                            fingerprint=fingerprint, skipped=out.skipped, separator=encoder.separator,
                            format=SHARD_FORMAT, created=datetime.datetime.now(datetime.UTC).isoformat(),
                            tokenizer=encoder.tokenizer, tokenizer_sha256=info.sha256 if info else None,
                            dtype=encoder.dtype, documents=out.documents)
        _publish(tmp.name, _beside(base, ".bin"))
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    # The manifest lands last: a reader that finds it current also finds the matching .bin.
    _write_atomic(_beside(base, ".json"), json.dumps(asdict(manifest), indent=2) + "\n")
    return Shard(_beside(base, ".bin"), manifest)


def _encode_file(path: Path, encoder: ByteEncoder | TokenizerEncoder, out: _Writer, bar) -> int:
    """Encode one file's documents in batches of about BATCH_TEXT; returns how many were kept."""
    batch: list[str | bytes] = []
    kept = size = shown = 0
    for doc, read in documents(path):
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_TEXT:
            kept += out.write(encoder.encode(batch))
            batch, size = [], 0
            if bar is not None:
                bar.update(read - shown)
                shown = read
    if batch:
        kept += out.write(encoder.encode(batch))
    if bar is not None:
        bar.update(path.stat().st_size - shown)
    return kept


def _progress_bar(source: Corpus, files: list[Path], encoder: ByteEncoder | TokenizerEncoder):
    """tqdm's bar over the corpus's bytes (tqdm.auto: a widget in a notebook), or None without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    verb = f"tokenising with {Path(encoder.tokenizer).parent.name}" if encoder.tokenizer else "reading"
    return tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True,
                desc=f"{verb} {source.root.name}", leave=False)


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
