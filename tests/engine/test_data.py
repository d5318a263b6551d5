"""Byte-level data: the shard cache, and batches that depend on (seed, step) alone."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.config import Config
from workbench.engine.data import SEPARATOR, TokenData, default_cache_dir, prepare, prepare_default_corpus

REPO = Path(__file__).resolve().parents[2]


def _write_corpus(folder: Path, n_files: int = 12, size: int = 8_000) -> Path:
    """A folder of plain text whose content is known, large enough for small batches."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz \n", dtype=np.uint8)
    for i in range(n_files):
        sub = folder / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_bytes(letters[rng.integers(0, len(letters), size)].tobytes())
    return folder


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("stdlib-cache")
    prepare(None, cache)
    return cache


@pytest.fixture
def corpus(tmp_path) -> Path:
    return _write_corpus(tmp_path / "corpus")


def test_default_corpus_is_the_standard_library(stdlib_cache):
    data = TokenData(batch_size=4, seq_len=64, cache_dir=stdlib_cache)
    manifest = data.shard.manifest
    assert Path(manifest.source) == Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert manifest.files > 100 and manifest.bytes > 1_000_000
    assert manifest.bytes == data.shard.path.stat().st_size
    text = bytes(data.global_batch(0)[0].to(torch.uint8).tolist()).decode("utf-8", errors="replace")
    assert len(text) >= 65
    assert data.global_batch(0).max() < 256


def test_batches_are_a_function_of_seed_and_step(stdlib_cache):
    a = TokenData(batch_size=8, seq_len=32, seed=3, cache_dir=stdlib_cache)
    b = TokenData(batch_size=8, seq_len=32, seed=3, cache_dir=stdlib_cache)
    other_seed = TokenData(batch_size=8, seq_len=32, seed=4, cache_dir=stdlib_cache)
    for step in (0, 1, 17, 10_000):
        batch = a.global_batch(step)
        assert batch.shape == (8, 33) and batch.dtype == torch.int64
        assert torch.equal(batch, b.global_batch(step))
        assert not torch.equal(batch, other_seed.global_batch(step))
    assert not torch.equal(a.global_batch(0), a.global_batch(1))


def test_targets_are_the_next_bytes_of_the_corpus(stdlib_cache):
    data = TokenData(batch_size=4, seq_len=16, seed=1, cache_dir=stdlib_cache)
    raw = np.fromfile(data.shard.path, dtype=np.uint8)
    for row, offset in zip(data.global_batch(5), data.offsets(5), strict=False):
        expected = torch.from_numpy(raw[offset:offset + 17].astype(np.int64))
        assert torch.equal(row, expected)
        inputs, targets = row[:-1], row[1:]
        assert torch.equal(inputs[1:], targets[:-1])


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
def test_data_parallel_slices_concatenate_to_the_global_batch(stdlib_cache, dp_size):
    data = TokenData(batch_size=8, seq_len=24, cache_dir=stdlib_cache)
    for step in (0, 9):
        slices = [data.local_batch(step, rank, dp_size) for rank in range(dp_size)]
        assert all(s.shape == (8 // dp_size, 25) for s in slices)
        assert torch.equal(torch.cat(slices), data.global_batch(step))


def test_a_batch_that_does_not_split_across_dp_is_refused(stdlib_cache):
    data = TokenData(batch_size=6, seq_len=8, cache_dir=stdlib_cache)
    with pytest.raises(ValueError, match="dp_size=4"):
        data.local_batch(0, 0, 4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        data.local_batch(0, 2, 2)


def test_resuming_at_step_k_replays_the_uninterrupted_run(stdlib_cache):
    uninterrupted = TokenData(batch_size=4, seq_len=32, seed=7, cache_dir=stdlib_cache)
    run = [uninterrupted.global_batch(step) for step in range(10)]
    # A resumed run is a fresh object (here also a fresh unpickled one, as a rank would receive it) that only knows k.
    resumed = pickle.loads(pickle.dumps(TokenData(batch_size=4, seq_len=32, seed=7, cache_dir=stdlib_cache)))
    for step in range(5, 10):
        assert torch.equal(resumed.global_batch(step), run[step])


def test_pickling_does_not_copy_the_corpus(stdlib_cache):
    data = TokenData(batch_size=4, seq_len=32, cache_dir=stdlib_cache)
    assert len(pickle.dumps(data)) < 10_000 < data.shard.manifest.bytes


def test_validation_split_is_disjoint_from_training_windows(corpus, tmp_path):
    data = TokenData(corpus, batch_size=4, seq_len=32, seed=0, cache_dir=tmp_path / "cache")
    total = data.shard.manifest.bytes
    assert data.train_tokens == total - round(0.05 * total)
    ends = np.concatenate([data.offsets(step) for step in range(2_000)]) + 33
    assert ends.max() <= data.train_tokens
    starts = np.concatenate([data.offsets(step) for step in range(2_000)])
    assert starts.min() >= 0
    raw = np.fromfile(data.shard.path, dtype=np.uint8)
    for i in range(data.num_val_batches):
        batch = data.val_batch(i)
        first = data.train_tokens + i * 4 * 32
        for j, row in enumerate(batch):
            start = first + j * 32
            assert start >= data.train_tokens and start + 33 <= total
            assert torch.equal(row, torch.from_numpy(raw[start:start + 33].astype(np.int64)))
        assert torch.equal(torch.cat([data.val_batch(i, r, 2) for r in range(2)]), batch)
    with pytest.raises(IndexError, match="out of range"):
        data.val_batch(data.num_val_batches)


def test_custom_folder_concatenates_sorted_files_with_separators(tmp_path):
    folder = tmp_path / "notes"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"alpha")
    (folder / "b" / "c.md").write_bytes(b"gamma")
    (folder / "b" / "0.txt").write_bytes(b"beta")
    (folder / ".hidden").write_bytes(b"secret")
    (folder / "image.bin").write_bytes(b"\x89PNG\x00\x01")
    shard = prepare(folder, tmp_path / "cache")
    sep = bytes([SEPARATOR])
    assert shard.path.read_bytes() == b"alpha" + sep + b"beta" + sep + b"gamma" + sep
    m = shard.manifest
    assert (m.files, m.skipped, m.bytes, m.source) == (3, 1, 17, str(folder.resolve()))


def test_a_folder_walk_keeps_os_walks_rules_in_sorted_relative_order(tmp_path):
    from workbench.corpus import Corpus

    root = tmp_path / "text"
    for folder in ("a", "a.b", ".git", "__pycache__", "site-packages", "z/deep"):
        (root / folder).mkdir(parents=True)
    for name in ("a/x.txt", "a.b/y.txt", "a.txt", ".git/config", "__pycache__/m.pyc", "site-packages/p.py",
                 "z/deep/w.txt", ".env"):
        (root / name).write_text(name)
    (root / "linked").symlink_to(root / "a", target_is_directory=True)  # a link to a folder is not walked
    (root / "alias.txt").symlink_to(root / "a.txt")  # a link to a file is a file
    source = Corpus.resolve(root)
    relative = [p.relative_to(source.root).as_posix() for p in source.files()]
    assert relative == ["a.b/y.txt", "a.txt", "a/x.txt", "alias.txt", "z/deep/w.txt"]  # "." sorts before "/"
    before = source.fingerprint(source.files())
    (root / "a" / "x.txt").write_text("changed, and longer")
    assert source.fingerprint(source.files()) != before


def test_custom_folder_trains(corpus, tmp_path):
    data = TokenData(str(corpus), batch_size=4, seq_len=32, seed=0, cache_dir=tmp_path / "cache")
    assert data.shard.manifest.files == 12
    allowed = set(b"abcdefghijklmnopqrstuvwxyz \n") | {SEPARATOR}
    assert set(data.global_batch(3).flatten().tolist()) <= allowed


def test_cache_is_built_once_and_reused(corpus, tmp_path):
    cache = tmp_path / "cache"
    first = prepare(corpus, cache)
    stat = first.path.stat()
    again = prepare(corpus, cache)
    assert again == first
    assert (again.path.stat().st_ino, again.path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert sorted(p.suffix for p in cache.iterdir()) == [".bin", ".json", ".lock"]


def test_cache_is_rebuilt_when_the_folder_changes(corpus, tmp_path):
    cache = tmp_path / "cache"
    before = prepare(corpus, cache)
    (corpus / "new.txt").write_bytes(b"more text")
    after = prepare(corpus, cache)
    assert after.manifest.files == before.manifest.files + 1
    assert after.manifest.bytes == before.manifest.bytes + len(b"more text") + 1
    assert after.manifest.sha256 != before.manifest.sha256


_RACE = """
import sys
from workbench.engine.data import prepare
print("ready", flush=True)
sys.stdin.readline()
print(prepare(None, sys.argv[1]).manifest.created, flush=True)
"""


@pytest.mark.processes
def test_ranks_starting_together_build_the_shard_once(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(cache)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    # Release both only once both have imported torch, so their calls to prepare really race.
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    created = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert created[0] == created[1] != ""
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    shard = prepare(None, cache)
    assert shard.manifest.created == created[0]
    assert shard.path.stat().st_size == shard.manifest.bytes


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        TokenData(missing, batch_size=2, seq_len=8, cache_dir=tmp_path / "cache")


def test_empty_folder_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{empty}.*no text files"):
        TokenData(empty, batch_size=2, seq_len=8, cache_dir=tmp_path / "cache")


def test_folder_of_binaries_is_named(tmp_path):
    folder = tmp_path / "blobs"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match=f"{folder}.*1 binary files skipped"):
        prepare(folder, tmp_path / "cache")


def test_too_small_a_corpus_is_named(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"x" * 2_000)
    with pytest.raises(ValueError, match=f"{folder}.*2001 bytes"):
        TokenData(folder, batch_size=16, seq_len=128, cache_dir=tmp_path / "cache")


def test_for_config_takes_batch_shape_and_seed(stdlib_cache):
    cfg = Config(batch_size=8, seq_len=64, seed=5)
    data = TokenData.for_config(cfg, cache_dir=stdlib_cache)
    assert (data.batch_size, data.seq_len, data.seed) == (8, 64, 5)
    assert data.global_batch(0).shape == (8, 65)


def test_prepare_default_corpus_summarises_the_shard(monkeypatch, stdlib_cache):
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(stdlib_cache))
    line = prepare_default_corpus()
    shard = prepare(None, stdlib_cache)
    assert line.startswith(shard.manifest.source) and f"{shard.manifest.files} files" in line
    assert line.endswith(str(shard.path))


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("WORKBENCH_DATA_CACHE")
    expected = REPO / "data" / "cache" if os.access(REPO / "data", os.W_OK) else Path.home() / ".cache/workbench/data"
    assert default_cache_dir() == expected


@pytest.mark.processes
def test_prepare_script(corpus, tmp_path):
    out = tmp_path / "shards"
    result = subprocess.run([sys.executable, str(REPO / "data" / "prepare.py"), "--source", str(corpus),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "12 files" in result.stdout
    assert len(list(out.glob("*.bin"))) == 1 and len(list(out.glob("*.json"))) == 1
    missing = subprocess.run([sys.executable, str(REPO / "data" / "prepare.py"), "--source", str(tmp_path / "no")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and str(tmp_path / "no") in missing.stderr
