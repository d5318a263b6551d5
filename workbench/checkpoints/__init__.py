"""Checkpoints on disk: their layout, content-addressed data, manifest and atomic commit, and how a load finds one.

    ckpt/
      step-000120/              complete: the data position (next step) is 120
        .metadata               torch.distributed.checkpoint's index: which chunk bytes hold each tensor shard
        manifest.json           SHA-256 of .metadata, every chunk it uses (digest → size), Config, counters,
                                loss scale (JSON: nothing to unpickle)
        COMMIT                  SHA-256 of manifest.json, written last
      chunks/3f/3fa2…e1         the data, content-addressed: a file named by the SHA-256 of its bytes, shared by
                                every checkpoint that holds those bytes, so an unchanged chunk is written once
      .step-000150.tmp-3f9a1c/  a save in progress, or one that was interrupted: never loaded, removed by the next save
      .lock                     held (flock) by the one save writing here, so no other save collects its chunks

A save writes the chunks it does not find in the store (each to a temporary
name, fsynced, then renamed to its digest), the index and manifest into the
hidden temporary directory, and only then renames that to `step-N`; a rename
within one directory is atomic, so an interrupted save leaves the checkpoints
already there as they were. A directory counts as a checkpoint only under its
final name, with a COMMIT that matches its manifest; `load("ckpt/")` takes the
newest and refuses if that one is damaged (never a silent fallback to an older
one), and checks every file and chunk against its SHA-256 before a rank reads it.
After each commit, chunks that no checkpoint's manifest names any more are deleted
(with `keep`, after the older checkpoints), never one a checkpoint still needs.

This package is the on-disk format only, pure (no torch, no processes): the
notebook uses it to check save options and to pick and verify a checkpoint,
rank 0 to commit one. Writing tensors into chunks and reading them back is
`workbench.engine.checkpoint_storage`'s (a DCP StorageWriter/StorageReader);
`Workbench.save/load` send the session's `save`/`load` commands.
"""

from workbench.checkpoints.write import commit, prune
from workbench.checkpoints.layout import (
    COMMIT,
    MANIFEST,
    CheckpointError,
    complete,
    final_dir,
    finals,
    is_committed,
    sha256_file,
    temp_dir,
)
from workbench.checkpoints.read import damage, resolve, verify
from workbench.checkpoints.manifest import (
    FORMAT,
    check_manifest,
    config_from_json,
    config_to_json,
    read_manifest,
    resume_state,
)
from workbench.checkpoints.options import SaveSchedule, check_options, schedule, writable_directory
from workbench.checkpoints.store import chunk_path, digests

__all__ = [
    "COMMIT", "FORMAT", "MANIFEST", "CheckpointError", "SaveSchedule", "check_manifest", "check_options",
    "chunk_path", "commit", "complete", "config_from_json", "config_to_json", "damage", "digests", "final_dir",
    "finals", "is_committed", "prune", "read_manifest", "resolve", "resume_state", "schedule", "sha256_file",
    "temp_dir", "verify", "writable_directory",
]
