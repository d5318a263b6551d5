"""The large-run path on this machine: torchrun launches acting as two nodes run the exported run.sh, ranks started as
a Slurm job's srun starts them resume, and their checkpoints and a notebook Workbench's open in each other,
continuing with the same losses."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from tests.local_launch import free_port, outputs_of
from workbench.export import Launch, export
from workbench.telemetry import jsonl
from workbench.ui.report import report_from_metrics

pytestmark = pytest.mark.processes  # make check leaves these out: each starts its own processes

# Same layout, same bytes, same reduction order on both sides (gloo, 2 ranks, fp32): the continuation is the same
# computation, so the losses are demanded bit-identical (and are).


def _two_nodes(run: Path, *extra: str) -> list[str]:
    """run.sh on "node 0" and "node 1" (one rank each) of this machine, meeting on loopback; their output."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHON=sys.executable,
               GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([str(run / "run.sh"), *extra], env=dict(env, NODE_RANK=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outputs = outputs_of(nodes, timeout=240)
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out
    return outputs


def _srun_tasks(config: Path, *args: str) -> list[str]:
    """Two ranks started as a Slurm job's srun starts its tasks when no torchrun runs under it (SLURM_PROCID,
    SLURM_NTASKS, and MASTER_ADDR/PORT exported by the job script); their output."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURM_NTASKS="2",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    tasks = [subprocess.Popen([sys.executable, "-m", "workbench.train", str(config), *args, "--device", "cpu"],
                              env=dict(env, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outputs = outputs_of(tasks, timeout=240)
    for task, out in zip(tasks, outputs):
        assert task.returncode == 0, out
    return outputs


def _losses(metrics: Path, rank: int = 0) -> dict[int, float]:
    return {m.step: m.loss for m in jsonl.read(metrics) if m.rank == rank}


def _same(a: list[float], b: list[float]) -> None:
    assert a == b and all(math.isfinite(x) for x in a), (a, b)


def test_torchrun_and_the_notebook_continue_each_others_checkpoints(pool, tmp_path):
    cfg = wb.Config(dp=2, zero=2, seed=3)
    run = tmp_path / "run"
    export(cfg, run, Launch(nnodes=2, nproc_per_node=1, device="cpu", steps=8, save_every=2))

    # torchrun, two "nodes": steps 0-3 (run.sh hands its arguments on: the last --steps is the one), checkpoints at 2
    # and 4, metrics from both ranks.
    outputs = _two_nodes(run, "--steps", "4")
    assert "step      3" in outputs[0] and "started by torchrun" in outputs[0]
    torchrun = _losses(run / "metrics.jsonl")
    assert sorted(torchrun) == [0, 1, 2, 3] and _losses(run / "metrics.jsonl", rank=1) == torchrun
    assert [d.name for _, d in wb.checkpoints.complete(run / "ckpt")] == ["step-000002", "step-000004"]
    # torchrun's log folder (each node's launch, its attempts) is the run's, not one more in /tmp.
    assert len(list((run / "torchrun-logs").glob("*/attempt_0"))) == 2

    # A notebook opens torchrun's step-2 checkpoint (its Config comes with it) and trains what torchrun trained next.
    bench = wb.Workbench(pool=pool)
    try:
        loaded = bench.load(run / "ckpt" / "step-000002")
        assert loaded["step"] == 2 and bench.config == cfg
        _same([m.loss for m in bench.train(2).wait()], [torchrun[2], torchrun[3]])

        # ... and the other way: the notebook saves at step 4; two tasks started as srun starts them resume it and
        # train 4-5, as the notebook does.
        saved = bench.save(tmp_path / "notebook_ckpt")
        assert saved.name == "step-000004"
        resumed = tmp_path / "resumed.jsonl"
        outputs = _srun_tasks(run / "config.json", "--resume", str(tmp_path / "notebook_ckpt"), "--steps", "6",
                              "--metrics", str(resumed), "--save-to", str(tmp_path / "after"))
        assert "started by srun" in outputs[0] and "next step 4" in outputs[0] and "resumed from" in outputs[0]
        notebook = [m.loss for m in bench.train(2).wait()]
    finally:
        bench.close()
    from_notebook_ckpt = _losses(resumed)
    assert sorted(from_notebook_ckpt) == [4, 5]
    _same([from_notebook_ckpt[4], from_notebook_ckpt[5]], notebook)
    assert (tmp_path / "after" / "step-000006").is_dir()  # the end of a run is always saved

    # The JSONL makes the page bench.report() makes: both ranks' steps, the layout from config.json.
    page = report_from_metrics(run / "metrics.jsonl", tmp_path / "run.html", run / "config.json").read_text()
    assert "dp2·zero2" in page and "<th>steps trained</th><td>4</td>" in page


def test_accelerate_launch_runs_the_exported_config(tmp_path):
    accelerate = Path(sys.executable).with_name("accelerate")
    if not accelerate.exists():
        import pytest

        pytest.skip("accelerate is not installed")
    run = tmp_path / "run"
    export(wb.Config(dp=2, seed=3), run, Launch(nnodes=1, nproc_per_node=2, device="cpu", steps=1, port=free_port()))
    # accelerate's launcher is torchrun's agent, whose log folder goes to the temporary folder: the test's own.
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    done = subprocess.run([str(accelerate), "launch", "--config_file", "accelerate.yaml", "-m", "workbench.train",
                           "config.json", "--steps", "1", "--device", "cpu"], cwd=run, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dp2 on 2 rank(s)" in done.stdout and sorted(_losses(run / "metrics.jsonl")) == [0]


def test_sigterm_stops_at_a_step_boundary_and_saves(tmp_path):
    # One process without a launcher (a FileStore world of 1), as a Slurm time limit's warning would find it.
    cfg_path = wb.Config(seed=3).save(tmp_path / "config.json")
    scratch = tmp_path / "tmp"  # the process's temporary folder: its one-rank store goes there, and must go away
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "workbench.train", str(cfg_path), "--steps", "100000", "--save-to",
                             str(tmp_path / "ckpt"), "--save-every", "100000", "--metrics",
                             str(tmp_path / "m.jsonl"), "--device", "cpu"],
                            env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(scratch)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step      2"):
                proc.terminate()
                break
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, out
    finally:
        proc.kill()
    steps = sorted(_losses(tmp_path / "m.jsonl"))
    assert 3 <= len(steps) < 100 and steps == list(range(len(steps)))
    assert [d.name for _, d in wb.checkpoints.complete(tmp_path / "ckpt")] == [f"step-{len(steps):06d}"]
    assert not list(scratch.glob("workbench-train-*")), "the one-rank store's folder was left behind"
