"""The content-addressed chunk store, without ranks or torch: how tensors are cut, what is shared, what is collected.

The invariant under test throughout: a committed checkpoint never depends on a chunk that was removed.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.checkpoint_disk import checkpoints_in, chunk_files, manifest, put_all, rewrite, save
from workbench import checkpoints as ck
from workbench.checkpoints import store

BIG, SMALL, CHUNK = 2 * store.SMALL_BYTES, store.SMALL_BYTES // 4, store.CHUNK_BYTES


def test_big_tensors_get_chunks_of_their_own_and_small_ones_are_packed():
    sizes = [SMALL, SMALL, 2 * CHUNK + 5, SMALL, BIG, 0, SMALL]
    assert store.cut(sizes) == [
        [(0, 0, SMALL), (1, 0, SMALL)],
        [(2, 0, CHUNK)], [(2, CHUNK, CHUNK)], [(2, 2 * CHUNK, 5)],  # cut into pieces of CHUNK_BYTES
        [(3, 0, SMALL)],
        [(4, 0, BIG)],
        [(5, 0, 0), (6, 0, SMALL)],
    ]
    many = store.cut([store.SMALL_BYTES - 1] * 100)  # packs close before they would pass CHUNK_BYTES
    assert all(sum(n for _, _, n in c) <= CHUNK for c in many) and sum(len(c) for c in many) == 100


def test_an_unchanged_tensor_cuts_into_the_same_chunks_whatever_changed_beside_it():
    """What makes a frozen layer cost nothing: chunk boundaries follow tensors, not byte offsets."""
    frozen = bytes(range(256)) * (BIG // 256)
    before = [b"a" * SMALL, b"b" * (BIG + 3), frozen, b"c" * 10]
    after = [b"A" * SMALL, b"B" * (BIG + 3), frozen, b"C" * 10]

    def chunks(items):
        return {bytes(b"".join(items[i][o:o + n] for i, o, n in c)) for c in store.cut([len(x) for x in items])}

    assert chunks(before) & chunks(after) == {frozen}


def test_a_chunk_is_written_once_and_a_truncated_one_is_written_again(tmp_path):
    digest, wrote = store.put(tmp_path, b"payload")
    assert wrote and store.chunk_path(tmp_path, digest).read_bytes() == b"payload"
    assert store.put(tmp_path, b"payload") == (digest, False)
    store.chunk_path(tmp_path, digest).write_bytes(b"pay")  # damaged in the store
    assert store.put(tmp_path, b"payload") == (digest, True)
    assert store.chunk_path(tmp_path, digest).read_bytes() == b"payload"
    assert [p.name for p in store.chunk_path(tmp_path, digest).parent.iterdir()] == [digest]  # no temporary left


def test_consecutive_saves_of_the_same_data_write_nothing_new(tmp_path):
    first = save(tmp_path, 10, [b"w" * BIG, b"m" * BIG])
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").glob("*/*")}
    second = save(tmp_path, 11, [b"w" * BIG, b"m" * BIG])
    assert ck.verify(first)["chunks"] == ck.verify(second)["chunks"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "chunks").glob("*/*")} == files  # not one rewritten


def test_keep_never_removes_a_chunk_a_remaining_checkpoint_reads(tmp_path):
    """A frozen embedding, saved with every checkpoint, then the oldest checkpoints removed by keep=2."""
    for step in range(1, 6):
        save(tmp_path, step, [b"frozen embedding", b"layers at step %d" % step], keep=2)
        for _, checkpoint in ck.complete(tmp_path):
            ck.verify(checkpoint)  # every survivor intact, after every collection
    assert checkpoints_in(tmp_path) == ["step-000004", "step-000005"]
    assert len(chunk_files(tmp_path)) == 3


def test_a_chunk_removed_before_the_commit_stops_the_commit(tmp_path):
    previous = save(tmp_path, 1, [b"kept"])
    with store.lock(tmp_path):
        chunks = put_all(tmp_path, [b"kept", b"new"])
        store.chunk_path(tmp_path, store.put(tmp_path, b"kept")[0]).unlink()  # gone between write and commit
        tmp = ck.temp_dir(tmp_path, 2, "ab12")
        tmp.mkdir()
        (tmp / ".metadata").write_bytes(b"index")
        with pytest.raises(ck.CheckpointError, match=r"step-000002: 1 chunk\(s\) it needs are not in the store"):
            ck.commit(tmp, ck.final_dir(tmp_path, 2), manifest(2, ck.digests(tmp, [".metadata"]), chunks))
    assert not ck.final_dir(tmp_path, 2).exists()
    assert ck.damage(previous) is not None  # the earlier checkpoint shared it: reported damaged, never loaded wrong


def test_the_chunks_of_a_damaged_checkpoint_whose_manifest_reads_are_kept(tmp_path):
    damaged = save(tmp_path, 1, [b"only in step 1"])
    (damaged / ck.COMMIT).unlink()
    save(tmp_path, 2, [b"only in step 2"], keep=1)
    its_chunk = hashlib.sha256(b"only in step 1").hexdigest()
    assert its_chunk in json.loads((damaged / ck.MANIFEST).read_text())["chunks"]
    assert its_chunk in chunk_files(tmp_path)  # repairable: its data is still there
    (damaged / ck.MANIFEST).write_bytes(b"{trunc")
    save(tmp_path, 3, [b"only in step 3"], keep=1)  # nothing can name it now: collected
    assert its_chunk not in chunk_files(tmp_path)


def test_a_second_writer_is_refused_while_a_save_holds_the_lock(tmp_path):
    with store.lock(tmp_path):
        with pytest.raises(ck.CheckpointError, match="another save is writing there now"):
            with store.lock(tmp_path):
                pass
    with store.lock(tmp_path):  # released
        pass


def test_a_re_signed_manifest_cannot_point_outside_the_store(tmp_path):
    final = save(tmp_path, 3)
    rewrite(final, chunks={"../../../etc/passwd": 10})
    with pytest.raises(ck.CheckpointError, match="'chunks' names '../../../etc/passwd', not a SHA-256"):
        ck.verify(final)
