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

Every writer is a pure function from a Config (and the launch's shape) to text, so each is tested without a
process; only `export` touches the disk.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from workbench.config import FP8, PRESETS, Config

Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class Launch:
    """How the ranks of a run are spread over machines, and what the training entry point is asked to do."""

    nnodes: int
    """Machines."""
    nproc_per_node: int
    """Ranks per machine: one per GPU on CUDA."""
    device: Device = "cuda"
    """"cuda" (NCCL, one GPU per rank) or "cpu" (gloo)."""
    steps: int = 1000
    """Optimizer steps the run trains."""
    save_every: int = 100
    """Checkpoint every this many steps (into ckpt/ beside config.json)."""
    async_save: bool = False
    """Write those checkpoints in the background while training goes on (torchtitan's checkpoint.async_mode)."""
    port: int = 29500
    """Rendezvous port on the first node."""

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node", "steps", "save_every", "port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save: must be True or False, got {self.async_save!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device: {self.device!r} is not 'cuda' or 'cpu'")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @classmethod
    def for_config(cls, cfg: Config, *, gpus_per_node: int = 8, device: Device = "cuda", **kwargs) -> "Launch":
        """Fill whole nodes of `gpus_per_node` ranks; a world smaller than a node runs on one node."""
        world = cfg.world_size
        per_node = min(gpus_per_node, world)
        if world % per_node:
            raise ValueError(f"gpus_per_node: the layout needs {world} ranks (dp·cp·tp·pp), which {per_node} ranks per "
                             f"node do not divide; choose gpus_per_node dividing {world}")
        return cls(nnodes=world // per_node, nproc_per_node=per_node, device=device, **kwargs)


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
            *(["--async-save"] if launch.async_save else [])]


def torchrun_command(launch: Launch, *, node_rank: str = "$NODE_RANK", master_addr: str = "$MASTER_ADDR",
                     master_port: str = "$MASTER_PORT", python: str = "python") -> str:
    """The torchrun command one node runs: c10d rendezvous at MASTER_ADDR:MASTER_PORT (the first node)."""
    args = [python, "-m", "torch.distributed.run", f"--nnodes={launch.nnodes}",
            f"--nproc-per-node={launch.nproc_per_node}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr}:{master_port}", *train_arguments(launch)]
    # Variables stay unquoted so the shell expands them; everything else is quoted.
    return " ".join(a if "$" in a else shlex.quote(a) for a in args)


def run_script(cfg: Config, launch: Launch) -> str:
    """run.sh: the torchrun launch, run once on every node of the job."""
    return f"""#!/usr/bin/env bash
# {cfg.layout}: {cfg.world_size} ranks as {launch.nnodes} node(s) x {launch.nproc_per_node} ({launch.device}).
# Run on every node, e.g. NODE_RANK=1 MASTER_ADDR=node0 ./run.sh ; extra arguments go to workbench.train
# (--resume ckpt/ continues from the latest checkpoint, one a notebook's bench.save() wrote included).
# The rendezvous store listens on MASTER_PORT of the first node: keep that port inside the cluster's network.
set -euo pipefail
cd "$(dirname "$0")"
NODE_RANK=${{NODE_RANK:-0}}
MASTER_ADDR=${{MASTER_ADDR:-127.0.0.1}}
MASTER_PORT=${{MASTER_PORT:-{launch.port}}}
exec {torchrun_command(launch, python="${PYTHON:-python}")} "$@"
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


_TITAN_SCHEDULE = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
_TITAN_FLAVORS = {"8b": "8B"}  # our presets with the shape of a torchtitan llama3 flavor
_TITAN_REGISTRY = {"8B": "llama3_8b"}  # torchtitan 0.3's config_registry function for each flavor
_TITAN_AC = {"none": "none", "selective": "selective", "full": "full"}


@dataclass(frozen=True)
class _TitanLayout:
    """`cfg`'s layout in torchtitan's terms, shared by both of its formats, and what torchtitan cannot express."""

    flavor: str
    local_batch: int
    replicate: int
    shard: int
    reshard: str
    precision: str
    missing: tuple[str, ...]


def _titan_layout(cfg: Config) -> _TitanLayout:
    missing: list[str] = []
    preset = next((name for name, m in PRESETS.items() if m == cfg.model), None)
    flavor = _TITAN_FLAVORS.get(preset or "")
    if flavor is None:
        missing.append(f"model shape {preset or 'custom'} ({cfg.model.num_params:,} parameters, vocab "
                       f"{cfg.model.vocab_size}): torchtitan's llama3 flavors are fixed shapes with a trained "
                       "tokenizer; flavor 8B is written, edit it or add a flavor")
    if cfg.model.vocab_size == 256:
        missing.append("byte-level tokens and the workbench's corpus: torchtitan reads a tokenizer and a dataset")
    if cfg.model.n_experts:
        missing.append(f"a mixture of experts ({cfg.model.n_experts} experts, ep={cfg.ep}): torchtitan's llama3 is "
                       "dense; its MoE models (deepseek_v3, llama4, qwen3) are other modules with their own shapes, "
                       "and its expert_parallel_degree borrows ranks from FSDP and TP rather than from dp")

    # Global batch = local_batch_size · dp · gradient accumulation; pipelines split the local batch instead.
    if cfg.pp > 1:
        local_batch = cfg.batch_size // cfg.dp
    else:
        local_batch = cfg.micro_batch_size  # torchtitan accumulates global / (local · dp) micro-batches
    replicate, shard, reshard = 1, 1, "default"
    if cfg.dp > 1:
        if cfg.zero == 0:
            replicate = cfg.dp
        elif cfg.zero == 1:
            replicate = cfg.dp
            missing.append("zero=1 (sharded optimizer state only): torchtitan has no ZeRO-1; written as plain "
                           "data parallel (data_parallel_replicate_degree), which holds the whole optimizer state")
        else:
            # HSDP: FSDP2 shards within groups of dp/dp_replicate and replicates across the groups, as here.
            replicate, shard = cfg.dp_replicate, cfg.dp // cfg.dp_replicate
            reshard = "never" if cfg.zero == 2 else "always"
    if cfg.cp > 1 and cfg.zero < 2:
        missing.append(f"zero={cfg.zero} with cp={cfg.cp}: torchtitan always applies FSDP over dp_shard·cp, so the "
                       "cp ranks shard the parameters there; the workbench replicates them (DDP over dp·cp)")
    titan_precision = {"fp32": "float32", "bf16": "bfloat16"}.get(cfg.precision, "bfloat16")  # fp8: bf16 beside
    if cfg.precision == "fp16":
        missing.append("precision=fp16 with dynamic loss scaling: torchtitan trains in bf16 (written as bfloat16)")
    if cfg.precision == "bf16":
        missing.append("bf16 as autocast over fp32 parameters: torchtitan's mixed_precision_param casts the "
                       "parameters FSDP gathers (and applies only under FSDP)")
    if cfg.activation_checkpointing == "selective":
        missing.append("recompute every other block: torchtitan 0.3's selective checkpointing is per operator "
                       "(it keeps the matmuls' outputs); torchtitan.toml writes layer-wise option 2 for older releases")
    if cfg.compression != "none":
        missing.append(f"compression={cfg.compression!r}: torchtitan syncs gradients uncompressed")
    if cfg.offload:
        missing.append("offload: torchtitan's training.enable_cpu_offload is FSDP2's CPUOffloadPolicy (zero 2/3 "
                       "here); the workbench's zero 0/1 host AdamW has no counterpart")
    if cfg.optimizer != "adamw":
        missing.append(f"optimizer={cfg.optimizer}: torchtitan builds Adam and AdamW only (written as AdamW)")
    if cfg.cuda_graphs:
        missing.append("cuda_graphs (torch.compile mode=\"reduce-overhead\"): torchtitan's compile settings have no mode")
    return _TitanLayout(flavor or "8B", local_batch, replicate, shard, reshard, titan_precision, tuple(missing))


def torchtitan_arguments(cfg: Config, launch: Launch) -> tuple[list[str], tuple[str, ...]]:
    """The arguments of `python -m torchtitan.train` (torchtitan 0.3) nearest to `cfg`, and what they cannot express.

    torchtitan 0.3 reads no job file: `--module llama3 --config llama3_8b` picks a config_registry function, and
    `--section.key value` overrides its fields (parsed by tyro, so an unknown key is an error); activation
    checkpointing is a subcommand, last. tests/test_export_torchtitan.py parses them with torchtitan's own
    ConfigManager.
    """
    t = _titan_layout(cfg)
    layout = {
        "training.local_batch_size": t.local_batch, "training.global_batch_size": cfg.batch_size,
        "training.seq_len": cfg.seq_len, "training.steps": launch.steps,
        "training.mixed_precision_param": t.precision, "training.mixed_precision_reduce": "float32",
        "training.max_norm": 1e9,  # effectively no clipping, as the workbench
        "parallelism.data_parallel_replicate_degree": t.replicate, "parallelism.data_parallel_shard_degree": t.shard,
        "parallelism.fsdp_reshard_after_forward": t.reshard, "parallelism.tensor_parallel_degree": cfg.tp,
        "parallelism.pipeline_parallel_degree": cfg.pp,
        # Causal load balancing: head-tail, rank r holding chunks r and 2·cp-1-r, as the workbench does.
        "parallelism.context_parallel_degree": cfg.cp, "parallelism.context_parallel_load_balancer": "headtail",
    }
    if cfg.pp > 1:
        layout["training.disable_cuda_graphs"] = True  # torchtitan 0.3 captures no pipeline in a CUDA graph yet
        layout["parallelism.pipeline_parallel_schedule"] = _TITAN_SCHEDULE[cfg.schedule]
        layout["parallelism.pipeline_parallel_microbatch_size"] = cfg.micro_batch_size
        if cfg.schedule == "interleaved_1f1b":
            layout["parallelism.pipeline_parallel_layers_per_stage"] = cfg.model.n_layers // (cfg.pp * cfg.stages_per_rank)
    # AdamW as the workbench runs it (torch's defaults but lr and weight decay), at a constant learning rate: no
    # warm-up, and a decay whose floor is the learning rate itself.
    adamw = "optimizer.param_groups.0.optimizer_kwargs"
    layout.update({f"{adamw}.lr": cfg.lr, f"{adamw}.weight_decay": cfg.weight_decay,
                   "lr_scheduler.warmup_steps": 0, "lr_scheduler.min_lr_factor": 1.0,
                   "debug.seed": cfg.seed, "checkpoint.enable": True, "checkpoint.interval": launch.save_every})
    if launch.async_save:
        layout["checkpoint.async_mode"] = "async"
    if cfg.compile:
        # Per transformer block, as the workbench compiles (torchtitan's default also compiles the loss).
        layout.update({"compile.enable": True, "compile.components": "model", "compile.backend": cfg.compile_backend})
    missing = list(t.missing)
    if cfg.precision in FP8:
        missing.append(f"precision={cfg.precision}: torchtitan 0.3 converts linears to Float8 in a config_registry "
                       "function (a Float8LinearConverter in its model_spec, rowwise recipes only), not by a "
                       "command-line override: add such a function for this flavor (torchtitan.toml has [float8])")
    args = ["--module", "llama3", "--config", _TITAN_REGISTRY[t.flavor]]
    for key, value in layout.items():
        if value is True:
            args.append(f"--{key}")  # tyro's boolean flags take no value
        else:
            args += [f"--{key}", repr(value) if isinstance(value, float) else str(value)]
    args += [f"--{adamw}.betas", "0.9", "0.999"]  # torch's AdamW default; torchtitan's is (0.9, 0.95)
    args.append(f"activation-checkpoint:{_TITAN_AC[cfg.activation_checkpointing]}")
    return args, tuple(missing)


def torchtitan_script(cfg: Config, launch: Launch) -> tuple[str, tuple[str, ...]]:
    """torchtitan.sh: torchrun of torchtitan 0.3's trainer on every node, and what it cannot express (listed in it)."""
    args, missing = torchtitan_arguments(cfg, launch)
    args.insert(-1, '"$@"')  # the script's own arguments: more overrides, before the subcommand (tyro's order)
    torchrun = ["${PYTHON:-python}", "-m", "torch.distributed.run", f"--nnodes={launch.nnodes}",
                f"--nproc-per-node={launch.nproc_per_node}", "--node-rank=$NODE_RANK", "--rdzv-backend=c10d",
                "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT", "-m", "torchtitan.train"]
    lines = " \\\n    ".join(" ".join(a if "$" in a else shlex.quote(a) for a in chunk)
                               for chunk in _flag_chunks([*torchrun, *args]))
    notes = "\n".join(f"#   - {item}" for item in missing)
    return f"""#!/usr/bin/env bash
# torchtitan (0.3) run nearest to the workbench layout {cfg.layout}: {cfg.world_size} ranks as {launch.nnodes} node(s)
# x {launch.nproc_per_node}. Run on every node, e.g. NODE_RANK=1 MASTER_ADDR=node0 ./torchtitan.sh ; extra arguments
# (--section.key value) go to torchtitan after these, overriding them. torchtitan needs its tokenizer
# (--hf_assets_path) and dataset.
# Not expressible in torchtitan's config (the workbench's value is in config.json):
{notes}
set -euo pipefail
cd "$(dirname "$0")"
NODE_RANK=${{NODE_RANK:-0}}
MASTER_ADDR=${{MASTER_ADDR:-127.0.0.1}}
MASTER_PORT=${{MASTER_PORT:-{launch.port}}}
exec {lines}
""", missing


def _flag_chunks(argv: list[str]) -> list[list[str]]:
    """argv cut before each of torchtitan's flags (and its subcommand), so the script shows one setting a line."""
    chunks: list[list[str]] = [[]]
    for arg in argv:
        past_launcher = "torchtitan.train" in chunks[0]
        if past_launcher and (arg.startswith("--") or arg.startswith("activation-checkpoint:")):
            chunks.append([])
        chunks[-1].append(arg)
    return chunks


def torchtitan_toml(cfg: Config, launch: Launch) -> tuple[str, tuple[str, ...]]:
    """The nearest torchtitan job config for `cfg`'s layout as the TOML job file of torchtitan releases before 0.3
    (`--job.config_file`), and what in `cfg` it cannot express. torchtitan 0.3 reads none: see `torchtitan_script`.

    Field names are torchtitan's JobConfig ([training], [parallelism], [activation_checkpoint], [optimizer],
    [compile], [float8], [checkpoint]).
    """
    t = _titan_layout(cfg)
    missing = [m for m in t.missing if not m.startswith("recompute every other block")]
    missing.append("a constant learning rate: torchtitan's scheduler decays it after warm-up (warmup_steps = 0 and "
                   "effectively no clipping are written; set [lr_scheduler] to hold it constant in your version)")
    flavor, local_batch, titan_precision = t.flavor, t.local_batch, t.precision
    replicate, shard, reshard = t.replicate, t.shard, t.reshard
    float8_lines = _float8_lines(cfg)

    ac_lines = ['mode = "none"']
    if cfg.activation_checkpointing == "full":
        ac_lines = ['mode = "full"']
    elif cfg.activation_checkpointing == "selective":
        # The workbench checkpoints every other block: torchtitan's layer-wise selective option "2".
        ac_lines = ['mode = "selective"', 'selective_ac_option = "2"  # every 2nd block, as the workbench does']
    pp_lines = []
    if cfg.pp > 1:
        pp_lines = [f'pipeline_parallel_schedule = "{_TITAN_SCHEDULE[cfg.schedule]}"',
                    f"pipeline_parallel_microbatch_size = {cfg.micro_batch_size}"]
        if cfg.schedule == "interleaved_1f1b":
            pp_lines.append(f"pipeline_parallel_layers_per_stage = "
                            f"{cfg.model.n_layers // (cfg.pp * cfg.stages_per_rank)}")
    lines = [
        f"# torchtitan job nearest to the workbench layout {cfg.layout} ({cfg.world_size} ranks).",
        "# Run with torchtitan's run_train.sh / torchrun; see the notes at the end for what differs.",
        "",
        "[job]",
        f'description = "workbench export: {cfg.layout}"',
        "",
        "[model]",
        'name = "llama3"',
        f'flavor = "{flavor}"',
        *(['converters = ["float8"]'] if float8_lines else []),
        "",
        *float8_lines,
        "[compile]",
        f"enable = {str(cfg.compile).lower()}",
        'components = ["model"]  # per transformer block, as the workbench compiles',
        f'backend = "{cfg.compile_backend}"',
        "",
        "[optimizer]",
        'name = "AdamW"',
        f"lr = {cfg.lr!r}",
        f"weight_decay = {cfg.weight_decay!r}",
        "",
        "[lr_scheduler]",
        "warmup_steps = 0",
        "",
        "[training]",
        f"local_batch_size = {local_batch}",
        f"global_batch_size = {cfg.batch_size}",
        f"seq_len = {cfg.seq_len}",
        f"steps = {launch.steps}",
        f'mixed_precision_param = "{titan_precision}"',
        'mixed_precision_reduce = "float32"',
        "max_norm = 1e9  # effectively no clipping, as the workbench",
        f"seed = {cfg.seed}",
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f'fsdp_reshard_after_forward = "{reshard}"',
        f"tensor_parallel_degree = {cfg.tp}",
        f"pipeline_parallel_degree = {cfg.pp}",
        *pp_lines,
        f"context_parallel_degree = {cfg.cp}",
        "",
        "[activation_checkpoint]",
        *ac_lines,
        "",
        "[checkpoint]",
        "enable_checkpoint = true",
        f"interval = {launch.save_every}",
        f'async_mode = "{"async" if launch.async_save else "disabled"}"',
        "",
        "# Not expressible in torchtitan's config (the workbench's value is in config.json):",
        *[f"#   - {item}" for item in missing],
    ]
    return "\n".join(lines) + "\n", tuple(missing)


def _float8_lines(cfg: Config) -> list[str]:
    """torchtitan's [float8] section for an fp8 precision (its model converter "float8"); none otherwise."""
    if cfg.precision not in FP8:
        return []
    if cfg.precision == "fp8_rowwise":
        return ["[float8]", 'recipe_name = "rowwise"', ""]
    fsdp = str(cfg.zero >= 2).lower()  # tensorwise: weights all-gathered in fp8 under FSDP2, as the workbench does
    return ["[float8]", f"enable_fsdp_float8_all_gather = {fsdp}",
            f"precompute_float8_dynamic_scale_for_fsdp = {fsdp}", ""]


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
