"""Training data: a corpus as one cached shard of tokens, and batches that are a pure function of (seed, step).

Tokens are bytes (vocabulary 256) unless the Config names a tokenizer, so
nothing is downloaded: the default corpus is the Python standard library's own
source, which every install has. The corpus is tokenised once into a file
under the cache directory (`workbench.shards`) and memory-mapped by every rank. A batch depends only on (seed, step) and not
on the parallel layout, so every layout sees the same data, and resuming at
step k replays exactly what an uninterrupted run would have seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workbench.config import Config
# The shard cache lives notebook-side (workbench.shards); its names stay importable from here.
from workbench.shards import Shard, default_cache_dir, prepare, prepare_default_corpus  # noqa: F401
from workbench.tokens import SEPARATOR  # noqa: F401

if TYPE_CHECKING:
    import torch


class TokenData:
    """Training and validation batches of tokens (bytes, or a tokenizer's ids) over one corpus.

    `global_batch(step)` is a pure function of (seed, step): random windows of
    seq_len + 1 tokens from the training split (the first 1 - val_fraction of
    the corpus). `local_batch` hands a data-parallel rank its contiguous rows of
    that global batch, so every layout trains on the same examples. Validation
    batches tile the held-out tail in order.
    """

    def __init__(self, corpus: str | Path | None = None, *, batch_size: int, seq_len: int, seed: int = 0,
                 val_fraction: float = 0.05, cache_dir: str | Path | None = None, shard: Shard | None = None,
                 tokenizer: str | Path | None = None) -> None:
        """`tokenizer`: `Config.tokenizer` (None: bytes). `shard`: one already prepared from `corpus` with it (a
        reshard keeps training on the text it trained on, and skips walking the folder again); None prepares it."""
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        self.batch_size, self.seq_len, self.seed, self.val_fraction = batch_size, seq_len, seed, val_fraction
        self.tokenizer = tokenizer
        self.shard = shard if shard is not None else prepare(corpus, cache_dir, tokenizer=tokenizer)
        self._tokens = self.shard.tokens()
        total = len(self._tokens)
        self.train_tokens = total - round(total * val_fraction)
        """Training windows lie in [0, train_tokens); validation windows in [train_tokens, end)."""
        self.num_val_batches = (total - self.train_tokens - 1) // seq_len // batch_size
        window = seq_len + 1
        if self.train_tokens < window or self.num_val_batches == 0:
            need = max(window, batch_size * seq_len + 1)
            unit = "bytes" if self.shard.manifest.tokenizer is None else "tokens"
            raise ValueError(f"corpus {self.shard.manifest.source} has {total} {unit}: too few for seq_len={seq_len} "
                             f"and batch_size={batch_size} (its {val_fraction:.0%} validation split needs at least "
                             f"{need} {unit}); use a larger folder or a smaller batch")

    @classmethod
    def for_config(cls, cfg: Config, corpus: str | Path | None = None, **kwargs) -> TokenData:
        """The data a `Config` trains on: its batch_size, seq_len, seed and tokenizer."""
        return cls(corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, tokenizer=cfg.tokenizer,
                   **kwargs)

    def offsets(self, step: int) -> np.ndarray:
        """Where each window of the global batch at `step` starts: drawn from a generator seeded by (seed, step)."""
        if step < 0:
            raise ValueError(f"step must be ≥ 0, got {step}")
        # SeedSequence mixes the pair into independent streams; % 2**64 admits negative seeds.
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed % 2**64, step])))
        return rng.integers(0, self.train_tokens - self.seq_len, size=self.batch_size, dtype=np.int64)

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
        first = self.train_tokens + i * self.batch_size * self.seq_len
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
        tokens = f"{m.tokens:,} tokens of {Path(m.tokenizer).parent.name}" if m.tokenizer else f"{m.bytes:,} bytes"
        return (f"TokenData({m.source!r}: {m.files} files, {tokens}, train {self.train_tokens:,}, "
                f"{self.num_val_batches} val batches; batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"seed={self.seed})")
