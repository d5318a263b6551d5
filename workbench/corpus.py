"""Which text a run trains on: the folder-to-files rule, and the check that refuses a corpus before ranks spawn.

Pure (no torch, no numpy), so the notebook side can refuse a missing, empty or
binary corpus when a Workbench is made or a layout applied, before any rank
is touched; shards.py builds its shard from the same `Corpus.files()`.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from workbench.config import ConfigError
from workbench.config.refusals import refuse
from workbench.documents import DocumentError, documents, kind

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def is_text(data: bytes) -> bool:
    """Whether a file's bytes count as text: no NUL byte (the shard's file separator; binary files have them)."""
    return b"\0" not in data


@dataclass(frozen=True)
class Corpus:
    """Where text comes from: a folder (or one file) and which files in it count."""

    root: Path
    suffix: str | None
    """Only files ending in this (".py" for the standard library); None takes every non-hidden file."""
    name: str
    """Short label used in the cache file's name."""

    @classmethod
    def resolve(cls, corpus: str | Path | None) -> Corpus:
        """None means the standard library's .py files; otherwise a folder of text files (or a single file)."""
        if corpus is None:
            root = Path(sysconfig.get_paths()["stdlib"]).resolve()
            return cls(root=root, suffix=".py", name=f"stdlib-{root.name}")
        root = Path(corpus).expanduser().resolve()
        if not root.exists():
            raise FileNotFoundError(f"corpus {root} does not exist; pass a folder of text files (or None for the "
                                    "Python standard library)")
        return cls(root=root, suffix=None, name=re.sub(r"[^A-Za-z0-9_.-]+", "_", root.name) or "corpus")

    def files(self) -> list[Path]:
        """Candidate files in a fixed order (sorted relative paths), so the concatenation is reproducible. Walked
        with os.scandir and plain strings: the standard library's ~1,800 files are walked in every notebook's first
        apply, where pathlib's objects cost ~3 times the walk."""
        if self.root.is_file():
            return [self.root]
        prefix = self._prefix()
        found: list[tuple[str, str]] = []  # (relative path with "/", full path)
        folders = [str(self.root)]
        while folders:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    name = entry.name
                    if name.startswith("."):  # hidden files and folders are not text
                        continue
                    if entry.is_dir():
                        # Installed packages are not the standard library, caches are not text, and a link to a
                        # folder is not followed (os.walk's rule).
                        if name not in _SKIPPED_DIRS and not entry.is_symlink():
                            folders.append(entry.path)
                    elif (not self.suffix or name.endswith(self.suffix)) and entry.is_file():
                        found.append((self._relative(entry.path, prefix), entry.path))
        found.sort()
        return [Path(full) for _, full in found]

    def fingerprint(self, files: list[Path]) -> str:
        """A hash of every file's relative path, size and modification time: changes when the folder does."""
        digest = hashlib.sha256()
        prefix = self._prefix()
        for path in files:
            full = str(path)
            relative = (self._relative(full, prefix) if full.startswith(prefix)
                        else path.relative_to(self.root).as_posix())
            stat = os.stat(full)
            digest.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    def _prefix(self) -> str:
        root = str(self.root)
        return root if root.endswith(os.sep) else root + os.sep

    @staticmethod
    def _relative(full: str, prefix: str) -> str:
        """A path under the root (`prefix`, from `_prefix`) relative to it, with "/" on every system."""
        return full[len(prefix):].replace(os.sep, "/")

    def cache_key(self) -> str:
        return f"{self.name}-{hashlib.sha256(f'{self.root}|{self.suffix}'.encode()).hexdigest()[:12]}"


def check_corpus(corpus: str | Path | None) -> None:
    """Refuse a corpus that cannot train: a path that does not exist, no files, or no text (every file empty or
    binary), or records whose text is not where it is read (a JSONL record or Parquet row without a "text" field,
    Parquet without pyarrow). Reads files in order only until the first one with text, so a real corpus costs one
    file (one record); None (the standard library) is always there."""
    if corpus is None:
        return
    if not isinstance(corpus, (str, os.PathLike)):
        raise ConfigError(f"corpus: expected a path, got {type(corpus).__name__}. Fix: pass a folder of text "
                          "files, or None for the Python standard library.")
    try:
        source = Corpus.resolve(corpus)
    except FileNotFoundError:
        raise ConfigError(f"corpus: {Path(corpus).expanduser()} does not exist. Fix: pass a folder of text files, "
                          "or None for the Python standard library.") from None
    files = source.files()
    if not files:
        raise ConfigError(f"corpus: {source.root} holds no files (hidden files and folders do not count). "
                          "Fix: point it at a folder holding text.")
    binary = 0
    for path in files:
        if kind(path) != "text":  # records: the first one must have its text where the reader looks
            try:
                first = next(documents(path), None)
            except DocumentError as e:
                raise refuse("corpus", e.problem, e.fix) from None
            except (OSError, UnicodeDecodeError):
                continue
            if first is not None:
                return
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if data and is_text(data):
            return
        binary += bool(data)
    raise ConfigError(f"corpus: none of the {len(files)} files in {source.root} holds text ({binary} binary, "
                      f"{len(files) - binary} empty or unreadable). Fix: point it at a folder holding text.")
