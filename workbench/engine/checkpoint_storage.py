"""torch.distributed.checkpoint (DCP) storage over the content-addressed chunk store (`workbench.checkpoints.store`).

Why a StorageWriter of our own rather than chunking the files DCP's
FileSystemWriter wrote: content-addressing after the fact writes every byte
once into DCP's shard files and then again into chunks, so an unchanged tensor
would still cost a full write per save. Here each rank cuts the tensor shards
DCP's plan gives it into chunks, hashes each in memory and writes only those the
store lacks, in the same pass. DCP keeps everything it is good at: the plans
(which rank writes which shard, replicated tensors written once), the index
(`.metadata`, which records for every shard where its bytes are) and resharding
on load (any layout reads any other's shards). What each shard's index entry
holds is ours: a plain tuple

    (kind, dtype, shape, ((chunk sha256, offset in the chunk, length), ...))

with kind "tensor" (raw bytes in the tensor's dtype) or "bytes" (a torch.save
blob; our checkpoints hold none). Plain tuples unpickle without any class, so the
index's restricted unpickler grows no allow-list for them.

Commit: DCP calls `finish` on the coordinator (rank 0) once every rank's
`write_data` returned, with all their results; there it writes `.metadata` and
hands the chunk list to the caller's commit (manifest, COMMIT, rename, prune). A
failure there reaches every rank as DCP's CheckpointException. The coordinator
holds the root's lock from planning to the end of the commit, so no other save
collects chunks this one reuses.

Safety on load: torch 2.13's FileSystemReader unpickles `.metadata` with plain
`pickle.load`; `ChunkReader` reads it through an allow-list of DCP's own record
classes and checks every index entry's shape before anything is read.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, \
    WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from workbench.checkpoints import store
from workbench.checkpoints.layout import METADATA, CheckpointError
from workbench.checkpoints.manifest import HEX64

Commit = Callable[[dict[str, str], dict[str, int]], None]
"""Rank 0's commit: (files in the checkpoint directory → SHA-256, chunks → size) once every chunk is down."""


class ChunkWriter(StorageWriter):
    """Writes this rank's shards as chunks into `root`'s store and, on the coordinator, the index and the commit.

    `written`/`reused`: bytes of chunks this rank wrote, and of those it found in the store already.
    """

    def __init__(self, root: Path, tmp: Path, commit: Commit | None) -> None:
        super().__init__()
        self.root, self.tmp, self._commit = Path(root), Path(tmp), commit
        self.written = self.reused = 0
        self._lock: contextlib.ExitStack | None = None

    # DCP's protocol -----------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator plans before any rank writes: the lock is held from here to the end of the commit.
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(store.lock(self.root))
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        views, kinds = [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                views.append(memoryview(data.getbuffer()).cast("B"))
                kinds.append(("bytes", "", ()))
            else:
                tensor = data.detach().cpu().contiguous()
                views.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
                kinds.append(("tensor", str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        pieces: list[list[tuple[str, int, int]]] = [[] for _ in views]
        used: set[str] = set()
        for chunk in store.cut([len(v) for v in views]):
            parts = [views[i][offset:offset + length] for i, offset, length in chunk]
            digest, wrote = store.put(self.root, parts[0] if len(parts) == 1 else b"".join(parts))
            used.add(digest)
            at = 0
            for i, _, length in chunk:
                pieces[i].append((digest, at, length))
                at += length
                if wrote:
                    self.written += length
                else:
                    self.reused += length
        store.sync(self.root, used)
        results = [WriteResult(index=item.index, size_in_bytes=len(view), storage_data=(*kind, tuple(p)))
                   for item, view, kind, p in zip(plan.items, views, kinds, pieces)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.version = "1.0.0"  # DCP's own format version of the index, as its FileSystemWriter writes it
        metadata.storage_meta = None
        data = pickle.dumps(metadata)
        with open(self.tmp / METADATA, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        chunks: dict[str, int] = {}
        for rank_results in results:
            for result in rank_results:
                for digest, offset, length in result.storage_data[3]:
                    chunks[digest] = max(chunks.get(digest, 0), offset + length)
        if self._commit is None:
            raise CheckpointError("the coordinator has no commit to run")
        self._commit(store.digests(self.tmp, [METADATA]), chunks)

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    # ours ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the root's lock (the coordinator's), whether the save succeeded or not; idempotent."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class ChunkReader(StorageReader):
    """Reads a checkpoint's shards back from the chunk store; its index through the allow-list, checked first."""

    def __init__(self, checkpoint: str | Path) -> None:
        super().__init__()
        self.path = Path(checkpoint)
        self.root = self.path.parent
        self.load_id = uuid.uuid4().hex
        self.metadata = _read_index(self.path / METADATA)
        self.storage_data = self.metadata.storage_data

    def reset(self, checkpoint_id: Any = None) -> None:
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        chunks = _LastChunk(self.root)
        # In store order, so the shards packed into one chunk are served by one read of it.
        for request in sorted(plan.items, key=lambda r: self.storage_data[r.storage_index][3][:1]):
            kind, dtype, shape, pieces = self.storage_data[request.storage_index]
            data = bytearray(sum(length for _, _, length in pieces))
            at = 0
            for digest, offset, length in pieces:
                chunks.read_into(digest, offset, memoryview(data)[at:at + length])
                at += length
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, io.BytesIO(bytes(data)))
                continue
            saved = _tensor(data, getattr(torch, dtype), shape)
            for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                saved = saved.narrow(dim, start, length)  # the part of the saved shard this rank holds now
            target = planner.resolve_tensor(request).detach()
            if target.size() != saved.size():
                raise CheckpointError(f"{request.storage_index.fqn}: the index gives {tuple(saved.size())}, this rank "
                                      f"needs {tuple(target.size())}")
            target.copy_(saved)
            planner.commit_tensor(request, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _tensor(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


class _LastChunk:
    """Reads pieces of chunks, keeping the last chunk read whole in memory (packed shards are read in order)."""

    def __init__(self, root: Path) -> None:
        self.root, self.digest, self.data = root, None, b""

    def read_into(self, digest: str, offset: int, out: memoryview) -> None:
        path = store.chunk_path(self.root, digest)
        if digest != self.digest:
            if offset == 0 and path.stat().st_size == len(out):  # a whole chunk: straight into place
                with open(path, "rb") as f:
                    if f.readinto(out) != len(out):
                        raise CheckpointError(f"{path}: shorter than its index says")
                return
            self.digest, self.data = digest, path.read_bytes()
        if offset + len(out) > len(self.data):
            raise CheckpointError(f"{path}: shorter than its index says")
        out[:] = self.data[offset:offset + len(out)]


# -- the index, read without running code from the file -----------------------------------------------------------
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else: any other global in the file is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _read_index(file: Path) -> Metadata:
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: refused ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file}: not torch.distributed.checkpoint metadata")
    for index, entry in metadata.storage_data.items():
        problem = _entry_problem(entry)
        if problem:
            raise CheckpointError(f"{file}: the entry for {getattr(index, 'fqn', index)!r} {problem}")
    metadata.storage_meta = StorageMeta()
    return metadata


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with an index entry (see the module docstring for its shape); None if nothing."""
    if not isinstance(entry, tuple) or len(entry) != 4:
        return f"is {type(entry).__name__}, not a chunk record of this workbench"
    kind, dtype, shape, pieces = entry
    if kind not in ("tensor", "bytes") or not isinstance(pieces, tuple):
        return "is not a chunk record of this workbench"
    if not all(isinstance(p, tuple) and len(p) == 3 and isinstance(p[0], str) and HEX64.match(p[0])
               and all(isinstance(n, int) and n >= 0 for n in p[1:]) for p in pieces):
        return "names a chunk that is not a SHA-256 in hex with an offset and a length"
    if kind == "tensor":
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            return f"has the dtype {dtype!r}, which torch does not know"
        if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
            return f"has the shape {shape!r}"
        numel = 1
        for n in shape:
            numel *= n
        if sum(p[2] for p in pieces) != numel * getattr(torch, dtype).itemsize:
            return "holds a number of bytes that its shape and dtype do not"
    return None
