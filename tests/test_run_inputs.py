"""What a run is given besides its Config (corpus, local world size, steps), refused before any rank is touched."""

from __future__ import annotations

import psutil
import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.corpus import check_corpus
from workbench.machine import RANK_MEMORY_BYTES, Machine, world_size_warning

GB = 2**30
LAPTOP = Machine(cores=2, total_bytes=24 * GB, available_bytes=20 * GB)


def _children() -> int:
    return len(psutil.Process().children(recursive=True))


# --- the corpus -------------------------------------------------------------------------------------------
def _refused(corpus, match):
    with pytest.raises(wb.ConfigError, match=match) as info:
        check_corpus(corpus)
    assert str(info.value).startswith("corpus:") and "Fix:" in str(info.value)


def test_missing_empty_and_binary_corpora_are_refused(tmp_path):
    _refused(tmp_path / "nowhere", "does not exist")
    empty = tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    (empty / ".hidden" / "notes.txt").write_text("hidden text does not count")
    _refused(empty, "holds no files")
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "blob.bin").write_bytes(b"\x7fELF\x00\x01")
    (binary / "zero.txt").write_bytes(b"")
    _refused(binary, r"none of the 2 files .* holds text \(1 binary, 1 empty")
    _refused(42, "expected a path")


def test_text_passes_and_reading_stops_at_the_first_text(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "b.txt").write_text("more text")
    check_corpus(None)  # the standard library
    check_corpus(tmp_path / "a.txt")  # one file is a corpus too
    read = []
    original = type(tmp_path).read_bytes
    monkeypatch.setattr(type(tmp_path), "read_bytes", lambda self: read.append(self.name) or original(self))
    check_corpus(tmp_path)
    assert read == ["a.txt"]


def test_the_workbench_refuses_it_before_spawning_a_rank(tmp_path):
    before = _children()
    with pytest.raises(wb.ConfigError, match="^corpus: .* does not exist"):
        wb.Workbench(2, corpus=tmp_path / "nowhere")
    assert _children() == before


# --- the local world size ------------------------------------------------------------------------------
def test_within_cores_and_memory_says_nothing():
    assert world_size_warning(2, LAPTOP) is None


def test_beyond_the_cores_or_the_available_memory_warns_with_the_estimate():
    assert "4 ranks share 2 cores" in world_size_warning(4, LAPTOP)
    tight = Machine(cores=64, total_bytes=24 * GB, available_bytes=4 * GB)
    warning = world_size_warning(16, tight)
    assert "16 ranks need about 6.2 GB" in warning and "4.0 GB are available" in warning


def test_beyond_the_memory_is_refused_unless_the_user_overrides():
    with pytest.raises(wb.ConfigError, match=r"^world_size: 64 ranks need about 25.0 GB.*24.0 GB.*"
                                             r"world_size ≤ 61, or pass oversubscribe=True"):
        world_size_warning(64, LAPTOP)
    assert "64 ranks share 2 cores" in world_size_warning(64, LAPTOP, oversubscribe=True)


def test_this_machine_is_read_and_the_workbench_refuses_before_spawning():
    here = Machine.this()
    assert here.cores >= 1 and here.total_bytes >= here.available_bytes > 0
    too_many = here.total_bytes // RANK_MEMORY_BYTES + 1
    before = _children()
    with pytest.raises(wb.ConfigError, match=f"^world_size: {too_many} ranks"):
        wb.Workbench(too_many)
    assert _children() == before


# --- steps ----------------------------------------------------------------------------------------------
def test_train_refuses_steps_that_are_no_count():
    bench = fake_workbench()
    bench.apply(wb.Config(dp=2))
    for steps in (True, 2.0, 0, -3, "10"):
        with pytest.raises(wb.ConfigError, match="^steps: must be a positive integer.*Fix:"):
            bench.train(steps=steps)
    assert bench.train(steps=2).wait()[-1].step == 1
