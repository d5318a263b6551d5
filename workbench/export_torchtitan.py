"""The nearest torchtitan run to a Config: torchtitan 0.3's command line (`--module llama3 --config llama3_8b` and
`--section.key value` overrides) and, for releases before 0.3, its TOML job file; each with what torchtitan
cannot express. Pure functions from a Config and its `Launch` to text (`workbench.export` writes them)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from workbench.config import FP8, PRESETS, Config
from workbench.config.tokenizer import tokenizer_path
from workbench.launch import Launch
from workbench.schedules import config_stages


_TITAN_SCHEDULE = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                   "interleaved_zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
"""Our schedule names → torchtitan's pipeline_parallel_schedule (torch's class names without "Schedule")."""
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
    if cfg.tokenizer is None:
        missing.append("byte-level tokens and the workbench's corpus: torchtitan reads a tokenizer (--hf_assets_path, "
                       "a folder holding tokenizer.json) and a dataset")
    else:
        missing.append(f"the workbench's corpus: torchtitan reads a dataset by name (--training.dataset, "
                       f"--training.dataset_path); the tokenizer is written as its folder, {tokenizer_folder(cfg)}")
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
    if cfg.precision == "bf16" and cfg.mixed_precision == "autocast":
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


def tokenizer_folder(cfg: Config) -> str:
    """The folder holding the Config's tokenizer.json: what torchtitan's hf_assets_path names."""
    return str(tokenizer_path(cfg.tokenizer).parent)


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
        if config_stages(cfg) > 1:  # the interleaved and V-shaped schedules: stages per rank from layers per stage
            per_stage = cfg.model.n_layers // (cfg.pp * config_stages(cfg))
            layout["parallelism.pipeline_parallel_layers_per_stage"] = per_stage
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
    if cfg.tokenizer is not None:  # torchtitan's HF tokenizer reads tokenizer.json (and its config) from a folder
        args += ["--hf_assets_path", tokenizer_folder(cfg)]
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
    elif cfg.activation_checkpointing == "op":
        ac_lines = ['mode = "selective"', 'selective_ac_option = "op"  # the per-op policy the workbench runs']
    pp_lines = []
    if cfg.pp > 1:
        pp_lines = [f'pipeline_parallel_schedule = "{_TITAN_SCHEDULE[cfg.schedule]}"',
                    f"pipeline_parallel_microbatch_size = {cfg.micro_batch_size}"]
        if config_stages(cfg) > 1:  # the interleaved and V-shaped schedules: stages per rank from layers per stage
            pp_lines.append(f"pipeline_parallel_layers_per_stage = "
                            f"{cfg.model.n_layers // (cfg.pp * config_stages(cfg))}")
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
        *([f'hf_assets_path = "{tokenizer_folder(cfg)}"'] if cfg.tokenizer is not None else []),
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
