"""torchtitan.sh against torchtitan itself: its own ConfigManager (tyro) parses the exported arguments, so a key
torchtitan does not have, or a value it refuses, fails here.

torchtitan is a test-only extra (`pip install -e ".[torchtitan]"`, see docs/large-run.md): its wheel pulls datasets,
tensorboard, wandb and torchdata, and the llama3 config registry imports triton (torchtitan's async
expert-parallel kernels), a gigabyte on disk. Where either is missing these tests are skipped, saying so; the
arguments themselves are still checked without torchtitan in tests/test_export.py.
"""

from __future__ import annotations

import shlex

import pytest

import workbench as wb
from workbench import export as ex

manager = pytest.importorskip("torchtitan.config.manager", reason="torchtitan is not installed (test-only extra)")
pytest.importorskip("triton", reason="torchtitan 0.3's llama3 config registry imports triton")

pytestmark = pytest.mark.slow  # the first parse imports torchtitan's models: ~20 s on 2 loaded cores

BIG = wb.ModelConfig.preset("8b")
LAYOUTS = {
    "hsdp·cp·ac full": wb.Config(model=BIG, dp=8, cp=2, zero=3, dp_replicate=2, precision="bf16", seq_len=8192,
                                 batch_size=16, activation_checkpointing="full", lr=3e-4, weight_decay=0.1, seed=7),
    "dp·tp·pp interleaved": wb.Config(model=BIG, dp=2, tp=2, pp=2, zero=2, schedule="interleaved_1f1b",
                                      micro_batches=4, batch_size=16, seq_len=4096),
    "ddp·cp": wb.Config(dp=2, cp=2, batch_size=8, seq_len=256),
    "fsdp·pp zbv": wb.Config(model=BIG, dp=2, pp=4, zero=2, schedule="zbv", micro_batches=8, batch_size=32,
                             seq_len=4096),
    "fsdp compiled": wb.Config(model=BIG, dp=8, zero=3, precision="bf16", compile=True, batch_size=16, seq_len=8192),
}
TITAN_SCHEDULES = {"interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}


def parse(args: list[str]):
    return manager.ConfigManager().parse_args(args)


@pytest.mark.parametrize("name", LAYOUTS)
def test_torchtitan_reads_the_exported_layout(name):
    cfg = LAYOUTS[name]
    launch = ex.Launch.for_config(cfg, steps=300, save_every=50, async_save=cfg.compile)
    args, _ = ex.torchtitan_arguments(cfg, launch)
    job = parse(args)
    par, train = job.parallelism, job.training
    replicate, shard = (cfg.dp_replicate, cfg.dp // cfg.dp_replicate) if cfg.zero >= 2 else (cfg.dp, 1)
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == (replicate, shard)
    assert (par.context_parallel_degree, par.tensor_parallel_degree, par.pipeline_parallel_degree) == \
        (cfg.cp, cfg.tp, cfg.pp)
    # torchtitan's world, as its ParallelDims multiplies it: the workbench's dp·cp·tp·pp.
    assert replicate * shard * par.context_parallel_degree * par.tensor_parallel_degree \
        * par.pipeline_parallel_degree == cfg.world_size == launch.world_size
    assert par.context_parallel_load_balancer == "headtail"
    assert (train.global_batch_size, train.seq_len, train.steps) == (cfg.batch_size, cfg.seq_len, 300)
    kwargs = job.optimizer.param_groups[0].optimizer_kwargs
    assert (kwargs["lr"], kwargs["weight_decay"], tuple(kwargs["betas"])) == (cfg.lr, cfg.weight_decay, (0.9, 0.999))
    assert (job.lr_scheduler.warmup_steps, job.lr_scheduler.min_lr_factor) == (0, 1.0)  # a constant lr
    assert job.debug.seed == cfg.seed and job.checkpoint.enable and job.checkpoint.interval == 50
    assert job.checkpoint.async_mode == ("async" if launch.async_save else "disabled")
    assert (job.compile.enable, job.compile.backend) == (cfg.compile, "inductor")
    if cfg.compile:
        assert list(job.compile.components) == ["model"]  # per block, as the workbench compiles
    ac = job.activation_checkpoint  # the subcommand: None, or FullAC.Config / SelectiveAC.Config
    assert (ac.__class__.__qualname__ if ac is not None else "none") == \
        {"none": "none", "full": "FullAC.Config", "selective": "SelectiveAC.Config"}[cfg.activation_checkpointing]
    if cfg.pp > 1:  # two stages per rank either way: interleaved with stages_per_rank=2, and ZBV's V
        assert par.pipeline_parallel_schedule == TITAN_SCHEDULES[cfg.schedule]
        assert par.pipeline_parallel_microbatch_size == cfg.micro_batch_size
        assert par.pipeline_parallel_layers_per_stage == BIG.n_layers // (cfg.pp * 2)


def test_the_script_runs_exactly_the_arguments_torchtitan_reads(tmp_path):
    cfg = LAYOUTS["hsdp·cp·ac full"]
    out = ex.export(cfg, tmp_path)
    text = out.files["torchtitan"].read_text()
    command = text[text.index("exec "):].replace("\\\n", " ")
    argv = shlex.split(command)
    argv = [a for a in argv[argv.index("torchtitan.train") + 1:] if a != "$@"]
    assert argv == ex.torchtitan_arguments(cfg, ex.Launch.for_config(cfg))[0]
    assert parse(argv).parallelism.context_parallel_degree == 2


def test_an_unknown_key_fails_the_parse():
    args, _ = ex.torchtitan_arguments(LAYOUTS["ddp·cp"], ex.Launch.for_config(LAYOUTS["ddp·cp"]))
    with pytest.raises(SystemExit):
        parse([*args[:-1], "--parallelism.context_parallel_dgree", "2", args[-1]])
