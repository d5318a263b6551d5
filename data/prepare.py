"""Build (or find) the cached shard of a corpus: `python data/prepare.py [--source DIR] [--tokenizer T] [--out DIR]`.

Ranks build the shard themselves on first use; running this beforehand only
moves that one-off cost out of the first training step, and prints what the
shard holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.shards import default_cache_dir, prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None,
                        help="folder (or file) of text; default: this Python's standard library *.py files")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json, or a Hugging Face tokenizer folder holding one; default: bytes")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"cache folder for the shard; default: {default_cache_dir()}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        shard = prepare(args.source, args.out, tokenizer=args.tokenizer, progress=True)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    m = shard.manifest
    tokens = f"{m.tokens:,} tokens ({m.tokenizer})" if m.tokenizer else f"{m.bytes:,} bytes"
    print(f"{m.source}: {m.files} files ({m.skipped} binary skipped), {tokens}, sha256 {m.sha256[:16]}…")
    print(f"shard {shard.path} (built {m.created}; {time.perf_counter() - start:.2f} s now)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
