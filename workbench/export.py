"""From the notebook to a large run: the files that run a Config without the notebook.

    bench.export("run/")        # or: wb.export(cfg, "run/", gpus_per_node=8)

writes, for the Config's layout (its world is dp·cp·tp·pp ranks):

    config.json      the whole Config; `python -m workbench.train run/config.json` trains it, `Config.load` reads it
    run.sh           the torchrun command, for each node (NODE_RANK, MASTER_ADDR from the environment)
    run.sbatch       a Slurm batch script: one task per node, each a torchrun that meets the others on the first node
    accelerate.yaml  the same launch as an `accelerate launch --config_file` configuration
    torchtitan.sh    the nearest torchtitan run as today's torchtitan (0.3) takes it: torchrun of `torchtitan.train`
                     with `--module llama3 --config llama3_8b` and `--section.key value` overrides (tyro); what it
                     cannot express is listed in it and returned (`Exported.unexpressed`)
    torchtitan.toml  the same job as a TOML job file, for torchtitan releases before 0.3 (`--job.config_file`)

Every writer is a pure function from a Config (and the launch's shape, `workbench.launch.Launch`) to text, so
each is tested without a process; only `export` touches the disk. torchtitan's translation is its own module,
`workbench.export_torchtitan`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from workbench.config import Config
from workbench.export_torchtitan import torchtitan_arguments, torchtitan_script, torchtitan_toml
from workbench.launch import Device, Launch, node_preamble

__all__ = ["Device", "Exported", "Launch", "accelerate_config", "config_json", "export", "run_script",
           "sbatch_script", "torchrun_command", "torchtitan_arguments", "torchtitan_script", "torchtitan_toml",
           "train_arguments"]


@dataclass(frozen=True)
class Exported:
    """What `export` wrote: the files by role, and the Config fields torchtitan's launch could not express."""

    directory: Path
    files: dict[str, Path]
    unexpressed: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"exported to {self.directory}:"] + [f"  {role:<12} {path.name}" for role, path in self.files.items()]
        if self.unexpressed:
            lines.append("torchtitan cannot express:")
            lines += [f"  - {item}" for item in self.unexpressed]
        return "\n".join(lines)


def config_json(cfg: Config) -> str:
    """config.json: every Config field (generic over the dataclass), read back by `Config.load`."""
    return json.dumps(cfg.to_dict(), indent=2) + "\n"


def train_arguments(launch: Launch, config: str = "config.json") -> list[str]:
    """The arguments of `python -m workbench.train` for this launch, paths relative to the export directory."""
    return ["-m", "workbench.train", config, "--steps", str(launch.steps), "--save-every", str(launch.save_every),
            "--save-to", "ckpt", "--metrics", "metrics.jsonl", "--device", launch.device,
            *(["--async-save"] if launch.async_save else []),
            *(["--corpus", launch.corpus] if launch.corpus is not None else [])]


TORCHRUN_LOGS = "torchrun-logs"
"""torchrun's log folder, in the run's folder (run.sh and run.sbatch start there)."""


def torchrun_command(launch: Launch, *, node_rank: str = "$NODE_RANK", master_addr: str = "$MASTER_ADDR",
                     master_port: str = "$MASTER_PORT", python: str = "python") -> str:
    """The torchrun command one node runs: c10d rendezvous at MASTER_ADDR:MASTER_PORT (the first node)."""
    args = [python, "-m", "torch.distributed.run", f"--nnodes={launch.nnodes}",
            f"--nproc-per-node={launch.nproc_per_node}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr}:{master_port}",
            # Where each launch's per-rank error files go: without it torchrun makes a folder in /tmp per launch,
            # never removed; here they stay with the run they explain.
            f"--log-dir={TORCHRUN_LOGS}", *train_arguments(launch)]
    # Variables stay unquoted so the shell expands them; everything else is quoted.
    return " ".join(a if "$" in a else shlex.quote(a) for a in args)


def run_script(cfg: Config, launch: Launch) -> str:
    """run.sh: the torchrun launch, run once on every node of the job."""
    return f"""#!/usr/bin/env bash
# {cfg.layout}: {cfg.world_size} ranks as {launch.nnodes} node(s) x {launch.nproc_per_node} ({launch.device}).
# Run on every node, e.g. NODE_RANK=1 MASTER_ADDR=node0 ./run.sh ; extra arguments go to workbench.train
# (--resume ckpt/ continues from the latest checkpoint, one a notebook's bench.save() wrote included).
# The rendezvous store listens on MASTER_PORT of the first node: keep that port inside the cluster's network.
{node_preamble(launch)}exec {torchrun_command(launch, python="${PYTHON:-python}")} "$@"
"""


def sbatch_script(cfg: Config, launch: Launch, *, time: str = "04:00:00") -> str:
    """run.sbatch: one Slurm task per node, each a torchrun whose rendezvous is on the job's first node."""
    gpus = f"#SBATCH --gpus-per-node={launch.nproc_per_node}\n" if launch.device == "cuda" else ""
    command = torchrun_command(launch, node_rank="$SLURM_NODEID", master_addr="$HEAD_NODE",
                               python="${PYTHON:-python}")
    # Single quotes: srun's shell on each node expands SLURM_NODEID; HEAD_NODE and MASTER_PORT are exported.
    return f"""#!/bin/bash
#SBATCH --job-name=workbench-{cfg.layout.replace("·", "-").replace("×", "x").replace(":", "")}
#SBATCH --nodes={launch.nnodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --time={time}
# {cfg.layout}: {cfg.world_size} ranks; torchrun starts {launch.nproc_per_node} per node.
set -euo pipefail
cd "${{SLURM_SUBMIT_DIR:-$(dirname "$0")}}"
export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${{MASTER_PORT:-{launch.port}}}
srun --kill-on-bad-exit=1 bash -c '{command} "$@"' workbench "$@"
"""


def accelerate_config(cfg: Config, launch: Launch) -> str:
    """accelerate.yaml: `accelerate launch --config_file accelerate.yaml -m workbench.train config.json` on each node.

    accelerate is only the launcher here: the layout (dp/tp/pp, ZeRO, recompute) comes from config.json, which the
    workbench's own engine applies, so the YAML asks for plain multi-process launching: MULTI_GPU, accelerate's
    torchrun-based launcher, whatever the device (its MULTI_CPU starts more than one process only through mpirun;
    the ranks use gloo on CPU because workbench.train is told `--device cpu`).
    """
    mixed = {"fp32": "'no'", "bf16": "bf16", "fp16": "fp16"}[cfg.precision]  # a bare no is YAML's false
    return f"""# {cfg.layout}: {cfg.world_size} ranks as {launch.nnodes} node(s) x {launch.nproc_per_node}.
# On node i: accelerate launch --config_file accelerate.yaml --machine_rank i --main_process_ip NODE0 \\
#     {" ".join(train_arguments(launch))}
# The parallel layout and precision are applied by the workbench from config.json, not by accelerate's plugins;
# MULTI_GPU is accelerate's torchrun launcher (on CPU too: the ranks take --device {launch.device}).
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: {launch.nnodes}
num_processes: {launch.world_size}
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: {launch.port}
rdzv_backend: c10d
same_network: true
mixed_precision: {mixed}
use_cpu: false
gpu_ids: all
downcast_bf16: 'no'
main_training_function: main
"""


def export(cfg: Config, directory: str | Path, launch: Launch | None = None, **launch_kwargs) -> Exported:
    """Write config.json, run.sh, run.sbatch, accelerate.yaml, torchtitan.sh and torchtitan.toml for `cfg` into
    `directory`.

    `launch` (or Launch.for_config's keywords: gpus_per_node, device, steps, save_every, async_save, port) says
    how the ranks are spread over nodes; its world must be the layout's dp·cp·tp·pp.
    """
    if launch is None:
        launch = Launch.for_config(cfg, **launch_kwargs)
    elif launch_kwargs:
        raise TypeError("pass either launch= or Launch.for_config's keywords, not both")
    if launch.world_size != cfg.world_size:
        degrees = "dp·cp·tp·pp" if cfg.cp > 1 else "dp·tp·pp"
        raise ValueError(f"launch: {launch.nnodes} node(s) x {launch.nproc_per_node} = {launch.world_size} ranks, "
                         f"but {cfg.layout} needs {degrees} = {cfg.world_size}")
    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    titan, missing = torchtitan_script(cfg, launch)
    texts = {"config": ("config.json", config_json(cfg)), "torchrun": ("run.sh", run_script(cfg, launch)),
             "sbatch": ("run.sbatch", sbatch_script(cfg, launch)),
             "accelerate": ("accelerate.yaml", accelerate_config(cfg, launch)),
             "torchtitan": ("torchtitan.sh", titan), "torchtitan_toml": ("torchtitan.toml", torchtitan_toml(cfg, launch)[0])}
    files = {}
    for role, (name, text) in texts.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
        files[role] = path
    return Exported(directory=out, files=files, unexpressed=missing)
