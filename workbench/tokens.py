"""How documents become the token ids a shard stores: bytes (the default: every byte a token, a NUL after each
document) or a tokenizer named by `Config.tokenizer` (its ids, its end-of-text token after each document).

No torch: the notebook tokenises a corpus into the data cache before its ranks map it (`workbench.shards`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workbench.config.tokenizer import TokenizerInfo
from workbench.corpus import is_text

SEPARATOR = 0
"""Byte written after every document by the byte encoder. Text never contains NUL (files that do are skipped as
binary), so it marks a document boundary unambiguously."""


class ByteEncoder:
    """Every byte a token: a document's UTF-8 bytes and a NUL after it; a document holding NUL is binary and
    left out."""

    dtype = "uint8"
    separator: int | None = SEPARATOR
    tokenizer = None

    def encode(self, docs: Sequence[str | bytes]) -> list[np.ndarray | None]:
        """Each document's tokens, separator included; None for one left out."""
        out: list[np.ndarray | None] = []
        for doc in docs:
            data = doc if isinstance(doc, bytes) else doc.encode("utf-8")
            out.append(np.frombuffer(data + bytes([SEPARATOR]), dtype=np.uint8) if is_text(data) else None)
        return out


class TokenizerEncoder:
    """A `tokenizers` tokenizer: each document encoded with its special tokens (a BOS where its post-processor adds
    one) and its end-of-text token after it. A text file holding NUL is binary and left out, as with bytes."""

    def __init__(self, info: TokenizerInfo) -> None:
        from tokenizers import Tokenizer

        self.info, self.dtype, self.separator = info, info.dtype, info.eos_id
        self.tokenizer = str(info.path)
        self._tokenizer = Tokenizer.from_file(str(info.path))

    def encode(self, docs: Sequence[str | bytes]) -> list[np.ndarray | None]:
        """Each document's ids (the batch encoded on the tokenizer's own threads); None for one left out."""
        keep = [i for i, d in enumerate(docs) if not isinstance(d, bytes) or is_text(d)]
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in (docs[i] for i in keep)]
        out: list[np.ndarray | None] = [None] * len(docs)
        for i, encoding in zip(keep, self._tokenizer.encode_batch_fast(texts, add_special_tokens=True), strict=True):
            ids = encoding.ids
            if self.separator is not None and (not ids or ids[-1] != self.separator):
                ids.append(self.separator)  # a post-processor that already ends with it (some do) gets no second
            out[i] = np.asarray(ids, dtype=self.dtype)
        return out


def encoder_for(info: TokenizerInfo | None) -> ByteEncoder | TokenizerEncoder:
    return ByteEncoder() if info is None else TokenizerEncoder(info)
