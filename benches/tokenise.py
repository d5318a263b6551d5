"""What tokenising a corpus into the data cache costs: the standard library's source (~31 MB here) built as a byte
shard and as a shard of a byte-level BPE's ids (trained here on 2 MB of the same text, 8,192 tokens), in one run.

    .venv/bin/python benches/tokenise.py

Prints each build's time and throughput and the tokenised build's time as a multiple of the byte build's: the
one-off cost `bench.apply` pays (with a progress bar) the first time a corpus meets a tokenizer.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from workbench.corpus import Corpus
from workbench.shards import prepare


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = Corpus.resolve(None).files()
    sample, size = [], 0
    for path in files[::7]:
        text = path.read_text(errors="replace")
        sample.append(text)
        size += len(text)
        if size > 2_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = _tokenizer(tmp)
        start = time.perf_counter()
        as_bytes = prepare(None, tmp / "cache")
        bytes_s = time.perf_counter() - start
        start = time.perf_counter()
        as_ids = prepare(None, tmp / "cache", tokenizer=tokenizer)
        ids_s = time.perf_counter() - start
        start = time.perf_counter()
        prepare(None, tmp / "cache", tokenizer=tokenizer)
        found_s = time.perf_counter() - start
    mb = as_bytes.manifest.bytes / 1e6
    print(f"corpus: {as_bytes.manifest.source}, {as_bytes.manifest.files} files, {mb:.1f} MB")
    print(f"bytes shard:     {bytes_s:6.2f} s  {mb / bytes_s:7.1f} MB/s")
    print(f"tokenised shard: {ids_s:6.2f} s  {mb / ids_s:7.1f} MB/s  {as_ids.manifest.tokens / ids_s / 1e6:.2f} M tokens/s "
          f"({as_ids.manifest.tokens:,} tokens, {as_bytes.manifest.bytes / as_ids.manifest.tokens:.2f} bytes a token)")
    print(f"tokenised / bytes: {ids_s / bytes_s:.1f}x; finding the built shard again: {found_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
