"""Train a Config without the notebook: the same engine, started by torchrun or Slurm's srun.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
        -m workbench.train run/config.json --steps 1000 --save-to run/ckpt --save-every 100
    srun python -m workbench.train run/config.json ...      # one task per rank; MASTER_ADDR/PORT exported

Each process is one rank, exactly as a pool's rank is: it runs the same commands a notebook sends
(`engine.session.apply`, `train`, `save`, `load`), so it builds the same model, trains
it on the same bytes in the same order, and writes checkpoints in the same format. A checkpoint this writes
opens with a notebook's `bench.load()`, and `--resume` continues from one a notebook's `bench.save()` wrote.

`--steps` is the step count the run ends at, counted from the start of training (a resumed run goes on to the
same end). Rank 0 prints progress; every rank appends its StepMetrics to the `--metrics` JSONL file, from
which `workbench.ui.report.report_from_metrics` (or `--report`) makes the page `bench.report()` makes.
SIGTERM or SIGUSR1 (Slurm's warning before a time limit) stops every rank at the same step and saves.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from workbench.config import Config


def world_from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    """This process's rank, world size and local rank: torchrun's variables, else Slurm's (srun), else one rank.

    Pure: reads `env` only, so it is tested without a launcher.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", "0")), "launcher": "torchrun"}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" not in env:
            raise RuntimeError("started by srun without torchrun: export MASTER_ADDR (the first node, e.g. "
                               "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)) and MASTER_PORT")
        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_NTASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", "0")), "launcher": "srun"}
    return {"rank": 0, "world_size": 1, "local_rank": 0, "launcher": "none"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workbench.train", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="config.json written by bench.export() or Config.save()")
    p.add_argument("--steps", type=int, required=True, help="train until this many steps are done (in total)")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from (its latest complete one)")
    p.add_argument("--save-to", default=None, help="directory for checkpoints (step-N inside)")
    p.add_argument("--save-every", type=int, default=None, help="save every N steps (and at the end)")
    p.add_argument("--keep", type=int, default=None, help="keep only the last K checkpoints")
    p.add_argument("--async-save", action="store_true",
                   help="write the periodic checkpoints in the background while training goes on (DCP async_save)")
    p.add_argument("--metrics", default="metrics.jsonl", help="JSONL file every rank appends its StepMetrics to")
    p.add_argument("--report", default=None, help="rank 0 writes the HTML report here at the end")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--corpus", default=None, help="folder or file of text, JSON Lines or Parquet (default: the Python "
                   "standard library's source); config.json's tokenizer says how it is tokenised")
    p.add_argument("--telemetry", action="store_true",
                   help="measure every step as the notebook does (compiled recording backend, memory, timeline)")
    p.add_argument("--log-every", type=int, default=1, help="rank 0 prints every N steps")
    return p.parse_args(argv)


class _Console:
    """Where a rank's events go here: its StepMetrics to the JSONL file, and rank 0's to the console."""

    def __init__(self, metrics_path: str, rank: int, log_every: int) -> None:
        from workbench.telemetry.jsonl import MetricsFile

        self.file, self.rank, self.log_every = MetricsFile(metrics_path), rank, log_every

    def __call__(self, message: dict) -> None:
        from workbench.telemetry.events import StepMetrics

        event = message.get("event")
        if message.get("type") != "event" or not isinstance(event, StepMetrics):
            return  # progress pings: nobody watches for hangs here but the launcher
        self.file.write(event)
        if self.rank == 0 and event.step % self.log_every == 0:
            note = f"  skipped: {event.skip_reason}" if event.skipped else ""
            print(f"step {event.step:>6}  loss {event.loss:.4f}  {event.tokens_per_s:,.0f} tokens/s  "
                  f"{event.step_time_s * 1e3:,.1f} ms  [{event.layout}]{note}", flush=True)


def _init_distributed(world: dict[str, Any], device: str, telemetry: bool) -> tuple[str, str]:
    """Start the world process group (gloo on CPU, NCCL on GPU); returns (device, backend)."""
    import torch
    import torch.distributed as dist

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(world["local_rank"])
        device = f"cuda:{world['local_rank']}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if telemetry:
        from workbench.telemetry import comm

        backend = comm.register()  # wraps gloo/NCCL and records every collective, as in the notebook's pool
    kwargs: dict[str, Any] = {"timeout": timedelta(minutes=30)}
    if device.startswith("cuda"):
        kwargs["device_id"] = torch.device(device)
    if world["launcher"] == "none":
        # One rank, no launcher: a FileStore in a private directory, so nothing listens on a port; the directory
        # goes when the process does (it was left behind, one per run).
        folder = tempfile.mkdtemp(prefix="workbench-train-")
        _PRIVATE.append(folder)
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
    else:
        dist.init_process_group(backend, init_method="env://", rank=world["rank"], world_size=world["world_size"],
                                **kwargs)
    return device, backend


_PRIVATE: list[str] = []
"""Folders this process made for itself (the one-rank store), removed on the way out."""


def _agreed(value: Any) -> Any:
    """Rank 0's `value` on every rank (a nonce, a verified manifest): ranks must name the same things."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resume(path: str) -> dict[str, Any]:
    """Load the latest complete checkpoint under `path` into the session (every rank; rank 0 verifies the files)."""
    import torch.distributed as dist

    from workbench import checkpoints
    from workbench.engine import session

    found = None
    if dist.get_rank() == 0:
        try:
            directory = checkpoints.resolve(path)
            found = (str(directory), checkpoints.verify(directory), None)
        except checkpoints.CheckpointError as e:
            found = (None, None, str(e))
    directory, manifest, error = _agreed(found)
    if error is not None:
        raise checkpoints.CheckpointError(error)
    info = session.load(directory, checkpoints.resume_state(manifest))
    return {"path": directory, "step": manifest["next_step"], "saved_layout": manifest["layout"], **info}


def save(directory: str, keep: int | None, nonce: str) -> Path:
    """Save the session as `directory`/step-N, in the format a notebook's `bench.load()` opens."""
    from workbench.engine import session

    return Path(session.save(directory, keep, nonce))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config.load(args.config)  # refused here, before any process group, if it is invalid
    world = world_from_env()
    cfg.check_world(world["world_size"])
    from workbench import checkpoints

    saves_dir = str(checkpoints.writable_directory(args.save_to)) if args.save_to else None
    if args.save_every is not None and saves_dir is None:
        raise SystemExit("--save-every needs --save-to DIR")

    import torch.distributed as dist

    from workbench.engine import session
    from workbench.pool import rank

    device, backend = _init_distributed(world, args.device, args.telemetry)
    # This process is a rank like a pool's: the session's commands read rank.info and report through rank.emit.
    rank.info = rank.RankInfo(world["rank"], world["world_size"], world["local_rank"], device, backend,
                              socket.gethostname())
    console = _Console(args.metrics, world["rank"], args.log_every)
    rank.host(console)
    run_id = _agreed(secrets.token_hex(8))

    def stop_at_next_step(signum: int, frame: Any) -> None:
        rank.set_flag("stop", run_id)  # the step's all-reduce carries the vote to every rank

    signal.signal(signal.SIGTERM, stop_at_next_step)
    signal.signal(signal.SIGUSR1, stop_at_next_step)

    info = session.apply(cfg, args.corpus, args.telemetry)
    say = print if world["rank"] == 0 else (lambda *a, **k: None)
    say(f"workbench.train: {cfg.layout} on {world['world_size']} rank(s) ({backend}, {device}, started by "
        f"{world['launcher']}); {info['params_local']:,} parameters on rank 0", flush=True)
    if args.resume:
        loaded = resume(args.resume)
        say(f"resumed from {loaded['path']} (saved by {loaded['saved_layout']}): next step {loaded['step']}",
            flush=True)
    nonce = _agreed(secrets.token_hex(4))
    saves = checkpoints.SaveSchedule(args.save_every, saves_dir, args.keep, args.async_save, nonce=nonce) if args.save_every else None
    remaining = max(0, args.steps - session.next_step())
    start = time.perf_counter()
    done = session.train(remaining, run_id, saves) if remaining else []
    last = Path(checkpoints.final_dir(saves_dir, session.next_step())) if saves_dir else None
    # Rank 0 decides for all (only it may see the directory): a save is a collective every rank must join.
    if saves_dir and done and _agreed(not last.exists()):
        last = save(saves_dir, args.keep, nonce)  # the end of the run (or of a stop) is always saved
    dist.barrier()
    console.file.close()
    if done:
        say(f"trained {len(done)} step(s) in {time.perf_counter() - start:.1f} s; final loss {done[-1].loss:.4f}"
            + (f"; checkpoint {last}" if last else ""), flush=True)
    if args.report and world["rank"] == 0:
        from workbench.ui.report import report_from_metrics

        say(f"report: {report_from_metrics(args.metrics, args.report, cfg)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        for folder in _PRIVATE:
            shutil.rmtree(folder, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo/NCCL threads can hang it
