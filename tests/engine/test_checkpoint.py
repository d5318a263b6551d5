"""Checkpoints through the ranks: any layout resumes any other's, a resume is bit-identical, bad ones are refused.

Tolerance across layouts: the losses after a load equal the single-process
reference within 1e-5 relative, as in test_parity (measured ≤ 2e-7). In the
same layout a resume is exact: the test compares floats with ==.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench import checkpoints as ck
from workbench.checkpoints import CheckpointError
from workbench.config import Config, ModelConfig
from workbench.engine import checkpoint
from workbench.engine.mesh import build_mesh
from workbench.engine.session import Session, current, drop
from workbench.engine.trainer import Trainer
from workbench.pool import rank

from tests.engine.rank_fns import SyntheticData, reference_run

BASE = Config(batch_size=8, seq_len=64)
LAYOUTS = {
    "dp2 zero0": dict(dp=2),
    "dp2 zero1": dict(dp=2, zero=1),
    "dp2 zero3": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "pp2 1f1b": dict(pp=2, micro_batches=2),
    "pp2 interleaved (2 chunks per rank)": dict(pp=2, micro_batches=2, schedule="interleaved_1f1b"),
    "dp2 zero1 ac selective": dict(dp=2, zero=1, activation_checkpointing="selective"),
    "dp2 zero3 ac full": dict(dp=2, zero=3, activation_checkpointing="full"),
}
SAVED_AT, THEN = 3, 3
# Workbenches run with telemetry=False (but one): these tests are about training state, not measurements.
CFG = Config(dp=2, batch_size=8, seq_len=64)
"""What the Workbench tests train: the real corpus, small batches."""
N = 12


# -- on the ranks ---------------------------------------------------------------------------------------
def _session(cfg: Config) -> Session:
    return Session(Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", SyntheticData(cfg)), 0)


def _train(session: Session, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(session.trainer.step(session.next_step).loss)
        session.next_step += 1
    return losses


def resume_in_layouts(source: Config, targets: dict[str, Config], directory: str) -> dict[str, list[float]]:
    """Train `source`, save, then load that checkpoint into each target layout and train on."""
    with rank.unchecked():  # engine collectives are symmetric by construction
        return _resume_in_layouts(source, targets, directory)


def _resume_in_layouts(source: Config, targets: dict[str, Config], directory: str) -> dict[str, list[float]]:
    session = _session(source)
    out = {"saved": _train(session, SAVED_AT)}
    checkpoint.save(session.trainer, session.next_step, directory, None, "feed")
    path = ck.resolve(directory)
    saved = ck.resume_state(ck.verify(path))
    for name, cfg in targets.items():
        target = _session(cfg)
        checkpoint.load(target.trainer, path, saved)
        target.next_step = saved["next_step"]
        out[name] = _train(target, THEN)
    return out


def save_untrained(cfg: Config, directory: str) -> None:
    with rank.unchecked():
        checkpoint.save(_session(cfg).trainer, 0, directory, None, "0ther")


def fingerprint() -> list[float]:
    """Checksums of this rank's weights and optimizer state: equal before and after means untouched."""
    session = current()
    params = [(p.to_local() if hasattr(p, "to_local") else p).detach()
              for m in session.trainer.modules for p in m.parameters()]
    state = [v.to_local() if hasattr(v, "to_local") else v for opt in session.trainer.optimizers
             for s in (opt.optim if hasattr(opt, "optim") else opt).state.values() for v in s.values()]
    return [float(sum(t.double().sum() for t in params)), float(sum(t.double().abs().sum() for t in state)),
            session.next_step, session.trainer.steps_done]


# -- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_run(BASE, SAVED_AT + THEN)["losses"]


@pytest.fixture
def bench(pool):
    """A Workbench on the shared pool, starting from no model; the model is dropped afterwards."""
    pool.run(drop)
    yield wb.Workbench(pool=pool, telemetry=False)
    if not pool.broken:
        pool.run(drop)


def trained_straight(pool, steps: int) -> list[float]:
    """CFG trained `steps` steps straight through on `pool`, no save: what every resume must reproduce."""
    if pool.broken:
        pool.restart()
    pool.run(drop)
    bench = wb.Workbench(pool=pool, telemetry=False)
    bench.apply(CFG)
    losses = [m.loss for m in bench.train(steps).wait()]
    pool.run(drop)
    return losses


@pytest.fixture(scope="module")
def straight(_session_pool) -> list[float]:
    return trained_straight(_session_pool, 2 * N)


# -- across layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["dp2 zero3", "dp2 zero1", pytest.param("tp2", marks=pytest.mark.smoke), "pp2 1f1b"])
def test_a_checkpoint_from_one_layout_continues_in_every_other(pool, reference, tmp_path, source):
    targets = {name: BASE.replace(**kw) for name, kw in LAYOUTS.items()}
    out = pool.run(resume_in_layouts, BASE.replace(**LAYOUTS[source]), targets, str(tmp_path))[0]
    assert out["saved"] == pytest.approx(reference[:SAVED_AT], rel=1e-5)
    for name in targets:
        assert out[name] == pytest.approx(reference[SAVED_AT:], rel=1e-5), f"{source} → {name}"


# -- through the Workbench ----------------------------------------------------------------------------------
def test_a_resume_in_a_new_workbench_is_bit_identical_to_training_straight_through(bench, straight, tmp_path):
    bench.apply(CFG)
    first = bench.train(N).wait()
    saved = bench.save(tmp_path)
    assert saved == tmp_path / f"step-{N:06d}"
    with wb.Workbench(2) as fresh:  # telemetry on: measuring must not change a bit of training
        info = fresh.load(tmp_path)  # no model yet: the saved Config is applied first
        assert fresh.config == CFG and info["step"] == N
        second = fresh.train(N).wait()
    assert [m.step for m in second] == list(range(N, 2 * N))
    assert [m.loss for m in first + second] == straight
    print(f"{2 * N} losses bit-identical (last {straight[-1]:.6f})")


def test_one_process_continues_a_two_rank_zero3_checkpoint(bench, straight, tmp_path):
    bench.apply(CFG.replace(zero=3))
    bench.train(N).wait()
    bench.save(tmp_path)
    with wb.Workbench(1, telemetry=False) as single:
        single.apply(CFG.replace(dp=1))
        single.load(tmp_path)
        losses = [m.loss for m in single.train(5).wait()]
    assert losses == pytest.approx(straight[N:N + 5], rel=1e-5)


def test_periodic_saves_keep_the_last_k_and_each_resumes_exactly(bench, straight, tmp_path):
    bench.apply(CFG)
    bench.train(12, save_every=4, save_to=tmp_path, keep=2).wait()
    assert [c.name for _, c in ck.complete(tmp_path)] == ["step-000008", "step-000012"]
    assert bench.load(tmp_path)["step"] == 12
    bench.load(tmp_path / "step-000008")
    assert [m.step for m in bench.history] == list(range(8))  # the steps after the checkpoint run again
    assert [m.loss for m in bench.train(4).wait()] == straight[8:12]


def test_bad_checkpoints_are_refused_and_training_is_untouched(bench, straight, tmp_path, pool):
    other = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2)
    pool.run(save_untrained, CFG.replace(model=other), str(tmp_path / "other"))
    bench.apply(CFG)
    bench.train(5).wait()
    good = bench.save(tmp_path / "good")
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copytree(good, ck.temp_dir(partial, 9, "dead"))  # a save interrupted before its rename
    # Copies of the whole directory: a checkpoint's data is in the chunk store beside it.
    flipped = shutil.copytree(good.parent, tmp_path / "flipped")
    chunk = max((flipped / "chunks").glob("*/*"), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    (tmp_path / "empty").mkdir()
    damaged = shutil.copytree(good.parent, tmp_path / "damaged")  # issue 17's drill: the newest one damaged
    truncated = shutil.copytree(good, ck.final_dir(damaged, 7))
    (truncated / ck.MANIFEST).write_bytes((truncated / ck.MANIFEST).read_bytes()[:50])
    forged = shutil.copytree(good.parent, tmp_path / "forged")
    _forge_manifest(forged / good.name, next_step=-7)
    before = pool.run(fingerprint)

    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "empty": "no complete checkpoint in",
        partial: r"incomplete, not loadable: \.step-000009\.tmp-dead",
        flipped: rf"chunks/../{chunk.name}: SHA-256 .* does not match its name: the chunk is corrupt .*step-000005",
        tmp_path / "other": r"parameter layers\.0\.attention\.wq\.weight: shape \(64, 64\) in the checkpoint, "
                            r"\(128, 128\) in this model",
        damaged: r"step-000007, the newest checkpoint in .* is damaged .*the newest intact one is .*step-000005",
        forged: r"step-000005, the newest checkpoint .* is damaged \(.*'next_step' must be an integer ≥ 0, got -7",
        forged / good.name: r"manifest field 'next_step' must be an integer ≥ 0, got -7",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as info:
            bench.load(path)
        print(f"{path.name}: {str(info.value).splitlines()[0]}")
    assert not pool.broken
    assert pool.run(fingerprint) == before
    assert bench.load(damaged / good.name)["step"] == 5  # named explicitly, the intact one loads
    assert [m.loss for m in bench.train(5).wait()] == straight[5:10]


class _Mkdir:
    """Unpickling this runs os.mkdir(path): a stand-in for any code a crafted file would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _forge(checkpoint_dir: Path, name: str, data: bytes) -> None:
    """Replace a file and re-sign the manifest, as someone handing over a crafted checkpoint would."""
    (checkpoint_dir / name).write_bytes(data)
    manifest_path = checkpoint_dir / ck.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = ck.sha256_file(checkpoint_dir / name)
    manifest_path.write_text(json.dumps(manifest))
    (checkpoint_dir / ck.COMMIT).write_text(ck.sha256_file(manifest_path))


def _forge_manifest(checkpoint_dir: Path, **fields) -> None:
    """Edit manifest fields and recompute the commit marker, as the drill did."""
    manifest_path = checkpoint_dir / ck.MANIFEST
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), **fields}))
    (checkpoint_dir / ck.COMMIT).write_text(ck.sha256_file(manifest_path))


def test_a_crafted_checkpoint_cannot_run_code_on_the_ranks(bench, tmp_path, pool):
    bench.apply(CFG)
    bench.train(2).wait()
    saved = bench.save(tmp_path / "ckpt")
    before = pool.run(fingerprint)
    marker = tmp_path / "code-ran"
    _forge(saved, ".metadata", pickle.dumps(_Mkdir(str(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused .*posix\.mkdir is not allowed"):
        bench.load(saved)
    assert not marker.exists()
    assert pool.run(fingerprint) == before


def test_dcp_would_run_code_from_non_tensor_values_and_the_safe_planner_refuses(tmp_path):
    """In one process (no ranks): torch 2.13's own planner unpickles with weights_only=False; ours does not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from workbench.engine.checkpoint_storage import ChunkReader, ChunkWriter

    marker = tmp_path / "code-ran"
    (tmp_path / "c").mkdir()
    dcp.save({"w": torch.ones(3), "extra": _Mkdir(str(marker))}, no_dist=True,
             storage_writer=ChunkWriter(tmp_path, tmp_path / "c", commit=lambda files, chunks: None))
    with pytest.raises(dcp.CheckpointException) as info:
        dcp.load({"w": torch.empty(3), "extra": None}, storage_reader=ChunkReader(tmp_path / "c"),
                 planner=checkpoint.SafePlanner(), no_dist=True)
    assert "extra: refused" in str(info.value) and "posix.mkdir" in str(info.value)
    assert not marker.exists()
    dcp.load({"w": torch.empty(3), "extra": None}, storage_reader=ChunkReader(tmp_path / "c"),
             planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists(), "the attack is real: torch's default planner ran it"
