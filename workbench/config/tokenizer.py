"""Which tokenizer a run names (`Config.tokenizer`): a local `tokenizer.json`, or a Hugging Face tokenizer folder
holding one, read for what a Config is checked against (its vocabulary) and what the data needs (its end of text).

None names the byte tokenizer, the default: every byte is a token (vocabulary 256) and nothing is read. The
`tokenizers` library (a dependency) is imported only when a file is named, and a file is read once per content:
`tokenizer_info` keeps what it found by its files' (size, modification time), so validating many Configs costs one
read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from workbench.config.refusals import ConfigError, refuse

TOKENIZER_FILE = "tokenizer.json"
"""The file a Hugging Face "fast" tokenizer folder holds, and what `tokenizers.Tokenizer.from_file` reads."""
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
"""Special tokens taken to end a document when no tokenizer_config.json says which (GPT-2/Qwen, Llama 3, Llama 2
and Mistral, Gemma, ChatML), in this order."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What a tokenizer file holds that a run needs, read once."""

    path: Path
    """The tokenizer.json."""
    vocab_size: int
    """Ids it can produce: one more than its largest id (special tokens included); the model must embed them all."""
    eos_id: int | None
    """The token written after every document (its tokenizer_config.json's eos_token, else the first of
    END_OF_TEXT it has); None: documents are concatenated with no marker."""
    sha256: str
    """Hash of the file: a shard records it, and is rebuilt when it changes."""

    @property
    def dtype(self) -> str:
        """The numpy dtype a shard of its ids is stored in: 2 bytes a token when every id fits, else 4."""
        return "uint16" if self.vocab_size <= 2**16 else "uint32"


def tokenizer_path(spec: str | os.PathLike) -> Path:
    """The tokenizer.json `spec` names (a file, or a folder holding one), absolute; refused, naming the field and
    the fix, when there is none."""
    path = Path(spec).expanduser().resolve()
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return path / TOKENIZER_FILE
        slow = sorted(p.name for p in path.iterdir() if p.name in ("vocab.json", "merges.txt", "tokenizer.model",
                                                                    "spiece.model", "vocab.txt"))
        raise refuse("tokenizer", f"{path} holds no {TOKENIZER_FILE}" + (f" (it has {', '.join(slow)}: a "
                     "\"slow\" tokenizer's files)" if slow else ""),
                     f"convert it once with transformers: AutoTokenizer.from_pretrained('{path}')"
                     f".save_pretrained('{path}') writes {TOKENIZER_FILE}; or pass a {TOKENIZER_FILE} file")
    if not path.is_file():
        raise refuse("tokenizer", f"{path} does not exist",
                     f"pass a local {TOKENIZER_FILE} or a Hugging Face tokenizer folder holding one (nothing is "
                     "downloaded), or None for bytes")
    return path


def tokenizer_info(spec: str | os.PathLike) -> TokenizerInfo:
    """The vocabulary and end-of-text token of the tokenizer `spec` names (cached per file content)."""
    path = tokenizer_path(spec)
    # The files beside it say which token ends a document: a change to them is a change of tokenizer too.
    stamps = tuple((s.st_size, s.st_mtime_ns) if (s := _stat(path.parent / name)) else None
                   for name in (TOKENIZER_FILE, *_SPECIAL_FILES))
    return _read(path, stamps)


_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


@functools.lru_cache(maxsize=16)
def _read(path: Path, stamps: tuple) -> TokenizerInfo:
    from tokenizers import Tokenizer

    data = path.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception subclass for any malformed file
        raise refuse("tokenizer", f"{path} is not a tokenizer the tokenizers library reads ({e})",
                     f"pass a {TOKENIZER_FILE} written by tokenizers or transformers") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not vocab:
        raise refuse("tokenizer", f"{path} has an empty vocabulary", "pass a trained tokenizer")
    eos = _end_of_text(path.parent, vocab)
    return TokenizerInfo(path=path, vocab_size=max(vocab.values()) + 1, eos_id=eos,
                         sha256=hashlib.sha256(data).hexdigest())


def _end_of_text(folder: Path, vocab: dict[str, int]) -> int | None:
    """The id of the token that ends a document: the folder's tokenizer_config.json (or special_tokens_map.json)
    eos_token when it names one the vocabulary has, else the first of END_OF_TEXT it has."""
    for name in _SPECIAL_FILES:
        try:
            eos = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):  # {"content": "</s>", "lstrip": false, ...}
            eos = eos.get("content")
        if isinstance(eos, str) and eos in vocab:
            return vocab[eos]
    return next((vocab[t] for t in END_OF_TEXT if t in vocab), None)


def check_tokenizer(spec: object) -> str | None:
    """`Config.tokenizer` as it is stored: None, or the absolute path of the file or folder named (so config.json
    means the same files wherever it is read); a path that names no tokenizer is refused."""
    if spec is None:
        return None
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ConfigError(f"tokenizer: expected a path, got {spec!r}. Fix: pass a local {TOKENIZER_FILE} or a "
                          "Hugging Face tokenizer folder holding one, or None for bytes.")
    tokenizer_info(spec)  # refuses what cannot be read, naming the field
    return str(Path(spec).expanduser().resolve())
