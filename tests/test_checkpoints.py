"""Checkpoint directories without ranks or torch: naming, atomic commit, interrupted saves, digests, choice, schema.

The chunk store itself (cutting, sharing, garbage collection) is tests/test_checkpoint_store.py's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint_disk import CFG, checkpoints_in, chunk_files, put_all, rewrite
from tests.checkpoint_disk import manifest as _manifest
from tests.checkpoint_disk import save as _save
from workbench import checkpoints as ck
from workbench.checkpoints import write as commit_module
from workbench.checkpoints import store
from workbench.config import Config, ModelConfig


def test_a_commit_renames_the_temporary_directory_into_a_complete_checkpoint(tmp_path):
    final = _save(tmp_path, 120)
    assert final == tmp_path / "step-000120"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "chunks", "step-000120"]
    assert sorted(p.name for p in final.iterdir()) == [".metadata", ck.COMMIT, ck.MANIFEST]
    assert ck.is_committed(final)
    manifest = ck.verify(final)
    assert manifest["next_step"] == 120 and manifest["format"] == ck.FORMAT
    assert set(manifest["files"]) == {".metadata"}
    assert set(manifest["chunks"]) == chunk_files(tmp_path) and len(manifest["chunks"]) == 2


def test_loading_a_directory_takes_the_latest_complete_checkpoint(tmp_path):
    for step in (5, 120, 30):
        _save(tmp_path, step)
    assert ck.resolve(tmp_path) == tmp_path / "step-000120"
    assert ck.resolve(tmp_path / "step-000030") == tmp_path / "step-000030"  # a checkpoint named directly
    assert [s for s, _ in ck.complete(tmp_path)] == [5, 30, 120]


@pytest.mark.parametrize("crash_at", ["before chunks", "during chunks", "before the commit marker",
                                      "before the rename"])
def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, crash_at):
    previous = _save(tmp_path, 10)
    tmp = ck.temp_dir(tmp_path, 20, "dead")
    tmp.mkdir()
    if crash_at != "before chunks":
        chunks = put_all(tmp_path, [b"new data of step 20"])
        (tmp_path / "chunks" / "ab").mkdir()
        (tmp_path / "chunks" / "ab" / ".tmp-abcdef-1234").write_bytes(b"half a chu")  # killed mid-write
    if crash_at in ("before the commit marker", "before the rename"):
        (tmp / ".metadata").write_bytes(b"index")

        def crash(path, data, real=commit_module._write_synced):
            if path.name == ck.COMMIT and crash_at == "before the commit marker":
                raise KeyboardInterrupt("killed")
            real(path, data)

        monkeypatch.setattr(commit_module, "_write_synced", crash)
        if crash_at == "before the rename":
            monkeypatch.setattr(commit_module.os, "rename",
                                lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
        with pytest.raises(KeyboardInterrupt):
            ck.commit(tmp, ck.final_dir(tmp_path, 20), _manifest(20, ck.digests(tmp, [".metadata"]), chunks), None)
    assert ck.resolve(tmp_path) == previous
    assert ck.verify(previous)["next_step"] == 10
    monkeypatch.undo()
    third = _save(tmp_path, 30, [b"step 30"])  # the next save clears the leftovers: directories and chunks
    assert checkpoints_in(tmp_path) == ["step-000010", "step-000030"]
    assert chunk_files(tmp_path) == set(ck.verify(previous)["chunks"]) | set(ck.verify(third)["chunks"])


def test_saving_the_same_step_again_replaces_it(tmp_path):
    _save(tmp_path, 7, [b"old"])
    final = _save(tmp_path, 7, [b"new"], nonce="cd34")
    assert checkpoints_in(tmp_path) == ["step-000007"]
    assert chunk_files(tmp_path) == set(ck.verify(final)["chunks"]) == {store.put(tmp_path, b"new")[0]}


def test_keep_holds_only_the_latest_checkpoints(tmp_path):
    for step in range(0, 60, 10):
        _save(tmp_path, step, [b"shared by all", b"only in step %d" % step], keep=2)
    assert checkpoints_in(tmp_path) == ["step-000040", "step-000050"]
    assert len(chunk_files(tmp_path)) == 3  # the shared chunk once, one of each survivor's own
    for step in (40, 50):
        ck.verify(ck.final_dir(tmp_path, step))


def test_a_flipped_byte_is_named_with_every_checkpoint_that_reads_it(tmp_path):
    _save(tmp_path, 2, [b"x" * 1000])
    final = _save(tmp_path, 3, [b"x" * 1000, b"y"])
    chunk = store.chunk_path(tmp_path, store.put(tmp_path, b"x" * 1000)[0])
    data = bytearray(chunk.read_bytes())
    data[500] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=rf"{chunk.name}: SHA-256 .* does not match its name.*checkpoints "
                                                 "that read it: step-000002, step-000003"):
        ck.verify(final)


@pytest.mark.parametrize("damage", ["missing chunk", "truncated chunk", "index changed", "extra file",
                                    "edited manifest", "unsafe name", "old format"])
def test_a_damaged_checkpoint_is_refused(tmp_path, damage):
    final = _save(tmp_path, 3, [b"x" * 100])
    chunk = store.chunk_path(tmp_path, store.put(tmp_path, b"x" * 100)[0])
    if damage == "missing chunk":
        chunk.unlink()
        match = rf"{chunk.name}: missing"
    elif damage == "truncated chunk":
        chunk.write_bytes(b"x" * 50)
        match = rf"{chunk.name}: 50 bytes, the manifest says 100"
    elif damage == "index changed":
        (final / ".metadata").write_bytes(b"another index")
        match = r"\.metadata: SHA-256 .* does not match the manifest's"
    elif damage == "extra file":
        (final / "evil.py").write_text("print('hi')")
        match = "files not in the manifest: \\['evil.py'\\]"
    elif damage == "unsafe name":
        rewrite(final, files={".metadata": "0" * 64, "../../etc/passwd": "0" * 64})
        match = "unsafe path"
    elif damage == "old format":
        rewrite(final, format=1)
        match = "checkpoint format 1, this workbench reads format 2"
    else:
        rewrite(final, remark=False, next_step=999)
        match = "does not match the commit marker"
    with pytest.raises(ck.CheckpointError, match=match):
        ck.verify(final)


@pytest.mark.parametrize("damage", ["manifest truncated", "commit marker deleted", "next_step -7, re-marked",
                                    "a chunk deleted"])
def test_a_damaged_newest_checkpoint_is_refused_naming_the_newest_intact_one(tmp_path, damage):
    """The drill of issue 17: load(root) used to take an older step without a word (10 steps lost)."""
    for step in (100, 110, 120):
        _save(tmp_path, step, [b"shared", b"only in %d" % step])
    newest = tmp_path / "step-000120"
    if damage == "manifest truncated":
        (newest / ck.MANIFEST).write_bytes((newest / ck.MANIFEST).read_bytes()[:40])
        why = "does not match the commit marker"
    elif damage == "commit marker deleted":
        (newest / ck.COMMIT).unlink()
        why = "commit marker COMMIT is missing"
    elif damage == "a chunk deleted":
        store.chunk_path(tmp_path, store.put(tmp_path, b"only in 120")[0]).unlink()
        why = "1 of its chunks are missing or truncated"
    else:
        rewrite(newest, next_step=-7)
        why = "'next_step' must be an integer ≥ 0, got -7"
    with pytest.raises(ck.CheckpointError) as info:
        ck.resolve(tmp_path)
    message = str(info.value)
    assert re.search(rf"step-000120, the newest checkpoint in .* is damaged \(.*{why}", message), message
    assert "the newest intact one is " + str(tmp_path / "step-000110") in message
    assert "10 steps earlier" in message and "nothing was loaded" in message
    assert ck.resolve(tmp_path / "step-000110") == tmp_path / "step-000110"  # the explicit argument
    assert ck.verify(tmp_path / "step-000110")["next_step"] == 110


def test_a_damaged_newest_checkpoint_with_nothing_older_intact_says_so(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    for step in (10, 20):
        (ck.final_dir(tmp_path, step) / ck.COMMIT).unlink()
    with pytest.raises(ck.CheckpointError, match="no older checkpoint there is intact either"):
        ck.resolve(tmp_path)


@pytest.mark.parametrize(("fields", "match"), [
    (dict(next_step=-7), "'next_step' must be an integer ≥ 0, got -7"),
    (dict(next_step="3"), "'next_step' must be an integer ≥ 0, got '3'"),
    (dict(next_step=True), "'next_step' must be an integer ≥ 0, got True"),
    (dict(next_step=4), "'next_step' is 4, but the directory is step-000003"),
    (dict(steps_done=2.5), "'steps_done' must be an integer ≥ 0"),
    (dict(skipped_steps=9), r"'skipped_steps' \(9\) exceeds steps_done \(3\)"),
    (dict(scaler={"scale": -1.0}), "'scaler' must be null or an object with exactly"),
    (dict(scaler={"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                  "_growth_tracker": 0}), "'scaler' must have a finite scale > 0"),
    (dict(scaler={"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 1.5, "growth_interval": 2000,
                  "_growth_tracker": 0}), "'scaler' must have a backoff_factor in"),
    (dict(config={**ck.config_to_json(CFG), "dp": 0}), "'config' is not a valid Config .*dp"),
    (dict(config="dp2"), "'config' must be an object"),
    (dict(world_size=4), "'world_size' is 4, but its config's layout dp2 has 2 ranks"),
    (dict(world_size=0), "'world_size' must be ≥ 1"),
    (dict(layout="tp2"), "'layout' is 'tp2', but its config's layout is 'dp2'"),
    (dict(torch=7), "'torch' must be a non-empty string"),
    (dict(files={".metadata": "abc"}), "'files' holds 'abc' for .metadata, not a SHA-256"),
    (dict(files={}), "'files' must be an object holding exactly '.metadata'"),
    (dict(chunks={"ab": 3}), "'chunks' names 'ab', not a SHA-256"),
    (dict(chunks={"a" * 64: -3}), "'chunks' gives chunk a{16}… the size -3"),
    (dict(steps=3), "'steps' is not a manifest field"),
])
def test_the_manifest_is_schema_checked_even_when_its_commit_marker_is_recomputed(tmp_path, fields, match):
    final = _save(tmp_path, 3)
    rewrite(final, **fields)
    with pytest.raises(ck.CheckpointError, match=match):
        ck.verify(final)
    assert ck.damage(final) is not None


def test_a_missing_manifest_field_is_named(tmp_path):
    final = _save(tmp_path, 3)
    manifest = json.loads((final / ck.MANIFEST).read_text())
    del manifest["steps_done"]
    (final / ck.MANIFEST).write_text(json.dumps(manifest))
    (final / ck.COMMIT).write_text(ck.sha256_file(final / ck.MANIFEST))
    with pytest.raises(ck.CheckpointError, match="'steps_done' is missing"):
        ck.verify(final)


def test_a_save_never_commits_a_manifest_that_a_load_would_refuse(tmp_path):
    tmp = ck.temp_dir(tmp_path, 5, "ab12")
    tmp.mkdir()
    (tmp / ".metadata").write_bytes(b"index")
    with pytest.raises(ck.CheckpointError, match="'steps_done' must be an integer"):
        ck.commit(tmp, ck.final_dir(tmp_path, 5), {**_manifest(5, ck.digests(tmp, [".metadata"]), {}),
                                                    "steps_done": -1})
    assert not ck.final_dir(tmp_path, 5).exists()


def test_clear_errors_for_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.resolve(tmp_path / "nope")
    with pytest.raises(ck.CheckpointError, match=r"no complete checkpoint in .*$"):
        ck.resolve(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointError, match="is a file"):
        ck.resolve(tmp_path / "file")
    ck.temp_dir(tmp_path, 40, "beef").mkdir()
    with pytest.raises(ck.CheckpointError, match=r"incomplete, not loadable: \.step-000040\.tmp-beef"):
        ck.resolve(tmp_path)
    final = _save(tmp_path, 50)
    (final / ck.COMMIT).unlink()  # a directory that lost its commit marker
    with pytest.raises(ck.CheckpointError, match="step-000050 is incomplete"):
        ck.resolve(final)


def test_an_unwritable_save_directory_is_refused_before_any_rank_is_asked(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointError, match="cannot save to .*file/ckpt"):
        ck.writable_directory(tmp_path / "file" / "ckpt")
    assert ck.writable_directory(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    with pytest.raises(ck.CheckpointError, match="cannot save to"):
        ck.schedule(5, tmp_path / "file" / "ckpt")


def test_config_round_trips_through_json():
    cfg = Config(model=ModelConfig(dim=64, n_layers=2, n_heads=2, ffn_dim=96), dp=2, zero=3, precision="fp16",
                 lr=1e-3, seed=7)
    assert ck.config_from_json(json.loads(json.dumps(ck.config_to_json(cfg)))) == cfg


def test_periodic_save_options_are_checked(tmp_path):
    assert ck.schedule(None, None) is None
    sched = ck.schedule(5, tmp_path / "ckpt", 3)
    assert sched.every == 5 and sched.keep == 3 and Path(sched.directory).is_absolute()
    with pytest.raises(ValueError, match="save_to"):
        ck.schedule(5, None)
    with pytest.raises(ValueError, match="save_every"):
        ck.schedule(None, "ckpt")
    with pytest.raises(ValueError, match="save_every"):
        ck.schedule(0, tmp_path / "ckpt")
    assert ck.schedule(5, tmp_path / "ckpt", asynchronous=True).asynchronous
    with pytest.raises(ValueError, match="async_save"):
        ck.schedule(None, None, asynchronous=True)
    with pytest.raises(ValueError, match="async_save: must be True or False"):
        ck.schedule(5, tmp_path / "ckpt", asynchronous="yes")


def test_the_module_does_not_import_torch():
    code = "import sys, workbench.checkpoints; sys.exit('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
