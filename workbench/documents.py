"""The documents in one corpus file: a text file is one document, a JSON Lines file one per record, a Parquet file
one per row; a record's or row's text is its "text" field.

Pure (no torch, no numpy). Parquet needs pyarrow (`pip install pyarrow`, or the `parquet` extra), imported only
when a Parquet file is read; without it such a corpus is refused before any rank is touched, saying so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

TEXT_FIELD = "text"
"""The field of a JSONL record, or column of a Parquet file, holding a document's text (as in most published
corpora: FineWeb, C4, The Pile, Wikipedia dumps)."""
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_ROWS = 1024
"""Rows read from a Parquet file at a time: its text column is never held whole."""


class DocumentError(ValueError):
    """A corpus file whose documents cannot be read: what is wrong (naming the file) and the fix."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


def kind(path: Path) -> str:
    """"jsonl", "parquet" or "text", from the file's suffix."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def documents(path: Path) -> Iterator[tuple[str | bytes, int]]:
    """The documents of `path` in file order, each with how many of the file's bytes are read once it is (for a
    progress bar): a text file's bytes as they are (one document), else each record's text as a str."""
    what = kind(path)
    if what == "jsonl":
        yield from _jsonl(path)
    elif what == "parquet":
        yield from _parquet(path)
    else:
        data = path.read_bytes()
        yield data, len(data)


def _jsonl(path: Path) -> Iterator[tuple[str, int]]:
    read = 0
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            read += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DocumentError(f"{path}, line {number}: not JSON ({e})", "make each line of a .jsonl file one "
                                    f"JSON object with a {TEXT_FIELD!r} field") from None
            yield _text(record, path, f"line {number}"), read


def _text(record: object, path: Path, where: str) -> str:
    text = record.get(TEXT_FIELD) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DocumentError(f"{path}, {where}: no string {TEXT_FIELD!r} field (it has {keys})",
                            f"put each document's text under {TEXT_FIELD!r}")
    return text


def parquet_module():
    """pyarrow.parquet, or a DocumentError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DocumentError("reading Parquet files needs pyarrow, which is not installed",
                            "pip install pyarrow (or workbench[parquet]), or convert the files to JSON Lines") from None
    return pq


def _parquet(path: Path) -> Iterator[tuple[str, int]]:
    pq = parquet_module()
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and others for a file that is not Parquet
        raise DocumentError(f"{path}: not a Parquet file pyarrow reads ({e})",
                            "pass Parquet files (or JSON Lines, or text)") from None
    if TEXT_FIELD not in file.schema_arrow.names:
        raise DocumentError(f"{path}: no {TEXT_FIELD!r} column (it has {file.schema_arrow.names})",
                            f"put each document's text in a {TEXT_FIELD!r} column")
    row, rows, size = 0, max(1, file.metadata.num_rows), path.stat().st_size
    for batch in file.iter_batches(batch_size=PARQUET_ROWS, columns=[TEXT_FIELD]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DocumentError(f"{path}, row {row}: {TEXT_FIELD!r} is {text!r}, not a string",
                                    "give every row its document's text")
            yield text, size * row // rows
