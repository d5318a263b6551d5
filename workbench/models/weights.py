"""A checkpoint's weights as a local folder of .safetensors files: checked, read in pieces, written back.

`index` reads only the files' headers (names, dtypes, shapes): enough to refuse, before any rank builds anything,
a checkpoint that does not fit the model (`problems`: a missing or an extra tensor, a shape, a dtype that does not
convert exactly), each named. `Weights` is the model's initial values read from the files (`init.InitialValues`):
each rank reads, of each tensor, only the piece it holds (a memory-mapped slice). `write` is the way back: every
tensor in safetensors files (one, or shards with transformers' index file past `max_shard_bytes`) and the
config.json beside them, which is what `from_pretrained` and `HFModel(folder, weights=folder)` read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.models.init import Region, cut

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""safetensors' dtype names."""
EXACT = {torch.float32: {torch.float32, torch.bfloat16, torch.float16}, torch.bfloat16: {torch.bfloat16},
         torch.float16: {torch.float16}}
"""A parameter's dtype → the stored dtypes that convert to it exactly (a bf16 checkpoint trains in fp32 as it is)."""


@dataclass(frozen=True)
class Entry:
    """One stored tensor: which file, its dtype and its shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def index(folder: str | Path) -> dict[str, Entry]:
    """Every tensor of the folder's .safetensors files, from their headers alone."""
    entries: dict[str, Entry] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise ValueError(f"{name}: stored twice, in {entries[name].file} and {path.name}")
            entries[name] = Entry(str(path), info["dtype"], tuple(info["shape"]))
    return entries


def problems(entries: Mapping[str, Entry], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
             aliases: Mapping[str, str] = {}) -> list[str]:
    """What keeps the stored tensors from loading into parameters `expected` ({name: (shape, dtype)}), one line
    each, naming the tensor. `aliases`: other names of tied parameters ({"lm_head.weight": "model.embed_tokens.weight"}),
    which a checkpoint may hold or not."""
    out = [f"{name}: missing from the checkpoint (the model has it, shape {tuple(shape)})"
           for name, (shape, _) in expected.items() if name not in entries]
    out += [f"{name}: in the checkpoint, not in the model" for name in entries
            if name not in expected and name not in aliases]
    for name, (shape, dtype) in expected.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if entry.shape != tuple(shape):
            out.append(f"{name}: shape {entry.shape} in the checkpoint, {tuple(shape)} in the model")
        stored = DTYPES.get(entry.dtype)
        if stored not in EXACT.get(dtype, {dtype}):
            out.append(f"{name}: stored as {entry.dtype}, which does not convert exactly to the model's {dtype}")
    return out


class Weights:
    """The initial values read from a folder of safetensors (`init.InitialValues`): each piece read alone."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.entries = index(folder)

    def pieces(self, wanted: Mapping[str, Region]) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        with contextlib.ExitStack() as files:
            opened: dict[str, object] = {}
            for name, region in wanted.items():
                entry = self.entries[name]
                if entry.file not in opened:
                    opened[entry.file] = files.enter_context(safe_open(entry.file, framework="pt"))
                yield name, _read(opened[entry.file].get_slice(name), region)


def _read(stored, region: Region) -> torch.Tensor:
    """The piece `region` of a stored tensor: its bounding box read from the file, then cut to the runs."""
    box = tuple(slice(min(a for a, _ in runs), max(b for _, b in runs)) if runs else slice(0, 0) for runs in region)
    shifted = tuple(tuple((a - s.start, b - s.start) for a, b in runs) for runs, s in zip(region, box))
    tensor = stored[box] if region else stored[:]
    return cut(tensor, shifted)


def write(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: dict, *,
          max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """`tensors` as safetensors in `folder` (sharded with model.safetensors.index.json past `max_shard_bytes`), and
    `config` as config.json; returns the files written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    written = []
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        written.append(folder / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, path.name))
            written.append(path)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index_path = folder / "model.safetensors.index.json"
        index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(index_path)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [*written, folder / "config.json"]
