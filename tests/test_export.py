"""Export without processes: config.json round trip, the launch scripts, accelerate's YAML, torchtitan's launch and TOML."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tomllib

import pytest

import workbench as wb
from workbench import export as ex
from workbench.train import world_from_env

LAYOUTS = [
    wb.Config(dp=2),
    wb.Config(dp=2, tp=2, zero=2, precision="bf16", activation_checkpointing="selective"),
    wb.Config(pp=2, dp=2, zero=3, schedule="interleaved_1f1b", micro_batches=4, stages_per_rank=2),
    wb.Config(model=wb.ModelConfig.preset("8b"), dp=8, zero=3, precision="bf16", seq_len=8192, batch_size=16,
              activation_checkpointing="selective", lr=3e-4, weight_decay=0.1, seed=7),
]


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: c.layout)
def test_config_json_round_trips_to_an_equal_config(cfg, tmp_path):
    assert wb.Config.from_dict(json.loads(ex.config_json(cfg))) == cfg
    assert wb.Config.load(cfg.save(tmp_path / "c.json")) == cfg


def test_config_json_is_generic_over_fields():
    # Every dataclass field is written, nested ModelConfig included: a field added later carries over unchanged.
    data = wb.Config().to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(wb.Config)}
    assert set(data["model"]) == {f.name for f in dataclasses.fields(wb.ModelConfig)}
    # Missing keys take defaults (an older config.json still loads); unknown ones are refused by name.
    assert wb.Config.from_dict({"dp": 2}) == wb.Config(dp=2)
    with pytest.raises(wb.ConfigError, match="model.dimm"):
        wb.Config.from_dict({"model": {"dimm": 3}})
    # Validation still happens: an impossible layout in a file is refused like one made in a cell.
    with pytest.raises(wb.ConfigError, match="^zero"):
        wb.Config.from_dict({"zero": 2})


@pytest.mark.processes
def test_export_writes_every_file_and_the_scripts_launch_the_layout(tmp_path):
    cfg = LAYOUTS[3]
    out = ex.export(cfg, tmp_path / "run", gpus_per_node=4, steps=500, save_every=50)
    assert sorted(p.name for p in out.files.values()) == sorted(
        ["config.json", "run.sh", "run.sbatch", "accelerate.yaml", "torchtitan.sh", "torchtitan.toml"])
    assert wb.Config.load(out.files["config"]) == cfg
    run = out.files["torchrun"].read_text()
    assert "--nnodes=2 --nproc-per-node=4" in run and "--rdzv-backend=c10d" in run
    assert "-m workbench.train config.json --steps 500 --save-every 50 --save-to ckpt" in run
    assert "MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}" in run  # nothing reaches beyond loopback unless asked
    sbatch = out.files["sbatch"].read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4"):
        assert line in sbatch
    assert "srun" in sbatch and "--node-rank=$SLURM_NODEID" in sbatch and "--rdzv-endpoint=$HEAD_NODE" in sbatch
    assert "--rdzv-id" not in run  # a single job's rendezvous needs no id beyond the endpoint
    assert "--log-dir=torchrun-logs" in run and "--log-dir=torchrun-logs" in sbatch  # not a folder in /tmp
    for script in ("run.sh", "run.sbatch", "torchtitan.sh"):
        subprocess.run(["bash", "-n", str(tmp_path / "run" / script)], check=True)  # the shell parses it


def test_a_launch_that_does_not_fill_the_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gpus_per_node"):
        ex.Launch.for_config(wb.Config(dp=6, batch_size=12), gpus_per_node=4)
    with pytest.raises(ValueError, match="dp·tp·pp = 2"):
        ex.export(wb.Config(dp=2), tmp_path, ex.Launch(nnodes=2, nproc_per_node=2))


def test_the_accelerate_yaml_is_read_by_accelerate_itself(tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    cfg = LAYOUTS[1]
    out = ex.export(cfg, tmp_path, gpus_per_node=2, device="cuda")
    parsed = config_args.ClusterConfig.from_yaml_file(out.files["accelerate"])
    assert parsed.num_processes == 4 and parsed.num_machines == 2
    assert str(parsed.distributed_type).endswith("MULTI_GPU") and str(parsed.mixed_precision).endswith("bf16")
    # fp32 is accelerate's "no", quoted: a bare no is YAML's false, which accelerate's launcher cannot read.
    out = ex.export(wb.Config(dp=2), tmp_path / "fp32", device="cpu")
    assert config_args.ClusterConfig.from_yaml_file(out.files["accelerate"]).mixed_precision == "no"


def test_the_torchtitan_toml_states_the_layout_and_what_it_cannot():
    toml, missing = ex.torchtitan_toml(LAYOUTS[3], ex.Launch(nnodes=1, nproc_per_node=8, steps=100))
    job = tomllib.loads(toml)
    assert job["model"]["flavor"] == "8B"  # our 8b preset is torchtitan's llama3 8B shape
    assert job["parallelism"]["data_parallel_shard_degree"] == 8
    assert job["parallelism"]["fsdp_reshard_after_forward"] == "always"
    assert job["training"]["local_batch_size"] == 2 and job["training"]["global_batch_size"] == 16
    assert job["training"]["mixed_precision_param"] == "bfloat16" and job["training"]["seq_len"] == 8192
    assert job["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert not any(m.startswith("model shape") for m in missing)
    for item in missing:
        assert f"#   - {item}" in toml

    toml, missing = ex.torchtitan_toml(LAYOUTS[2], ex.Launch(nnodes=1, nproc_per_node=4))
    job = tomllib.loads(toml)["parallelism"]
    assert job["pipeline_parallel_schedule"] == "Interleaved1F1B" and job["pipeline_parallel_degree"] == 2
    assert job["pipeline_parallel_microbatch_size"] == 2 and job["pipeline_parallel_layers_per_stage"] == 1
    assert any(m.startswith("model shape tiny") for m in missing)

    _, missing = ex.torchtitan_toml(wb.Config(dp=2, zero=1), ex.Launch(nnodes=1, nproc_per_node=2))
    assert any("zero=1" in m for m in missing)


def test_the_rank_comes_from_torchrun_else_slurm_else_one_process():
    assert world_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == {
        "rank": 3, "world_size": 8, "local_rank": 1, "launcher": "torchrun"}
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "MASTER_ADDR": "node0"}
    assert world_from_env(slurm) == {"rank": 5, "world_size": 16, "local_rank": 5, "launcher": "srun"}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        world_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert world_from_env({})["launcher"] == "none"


def test_step_metrics_survive_a_jsonl_line():
    from workbench.telemetry import jsonl

    m = wb.StepMetrics(step=3, loss=2.5, tokens=10, step_time_s=0.1, tokens_per_s=100.0, rank=1, layout="dp2",
                       memory={"parameters": 4}, intervals=(wb.Interval("comm", "all_reduce", 1, 2, 8, 2),),
                       pipeline_actions=((0, 1, "F", 5, 6),))
    assert jsonl.loads(jsonl.dumps(m)) == m


def test_the_torchtitan_launch_names_every_schedule_and_its_stages():
    # torchtitan's names are torch's classes without "Schedule"; the V-shaped ones hold two stages per rank.
    for schedule, name, spr in (("interleaved_zb", "InterleavedZeroBubble", 4), ("zbv", "ZBVZeroBubble", 2),
                                ("dualpipev", "DualPipeV", 2)):
        cfg = wb.Config(model=wb.ModelConfig.preset("8b"), dp=2, pp=4, zero=2, schedule=schedule, micro_batches=8,
                        stages_per_rank=4, batch_size=32, seq_len=4096)
        args, _ = ex.torchtitan_arguments(cfg, ex.Launch(nnodes=4, nproc_per_node=2))
        flags = {key: args[i + 1] for i, key in enumerate(args[:-1]) if key.startswith("--")}
        assert flags["--parallelism.pipeline_parallel_schedule"] == name, schedule
        assert flags["--parallelism.pipeline_parallel_layers_per_stage"] == str(32 // (4 * spr)), schedule
        job = tomllib.loads(ex.torchtitan_toml(cfg, ex.Launch(nnodes=4, nproc_per_node=2))[0])["parallelism"]
        assert job["pipeline_parallel_schedule"] == name


def test_the_torchtitan_launch_cuts_the_stages_as_the_workbench_does():
    # torchtitan (0.2+) weighs the embedding and the head as first/last_stage_less_layers blocks (1 each by
    # default): an even split is written as 0 and 0, torchtitan's own lighter ends as theirs.
    model = wb.ModelConfig.preset("8b")
    even = wb.Config(model=model, dp=2, pp=4, zero=2, micro_batches=4, batch_size=8, seq_len=4096)
    flags = _flags(even)
    assert (flags["--parallelism.pipeline_parallel_first_stage_less_layers"],
            flags["--parallelism.pipeline_parallel_last_stage_less_layers"]) == ("0", "0")
    lighter = even.replace(stage_layers=wb.lighter_ends(32, 4))  # (8, 9, 8, 7): the remainder to the first
    assert lighter.stage_layers == (8, 9, 8, 7)
    flags = _flags(lighter)
    assert (flags["--parallelism.pipeline_parallel_first_stage_less_layers"],
            flags["--parallelism.pipeline_parallel_last_stage_less_layers"]) == ("1", "1")
    # Two stages per rank are torchtitan's default for a multi-stage schedule (no layers per stage gives 8 of
    # the 34 units); four are asked for by layers per stage, ceil((32 + 0 + 0) / 2) = 16 stages.
    looped = lighter.replace(schedule="interleaved_1f1b", stages_per_rank=2, stage_layers=wb.lighter_ends(32, 8))
    flags = _flags(looped)
    assert flags["--parallelism.pipeline_parallel_first_stage_less_layers"] == "1"
    assert "--parallelism.pipeline_parallel_layers_per_stage" not in flags
    flags = _flags(looped.replace(stages_per_rank=4, stage_layers=()))
    assert flags["--parallelism.pipeline_parallel_layers_per_stage"] == "2"
    # A split torchtitan's weights cannot make is said, not written.
    odd = even.replace(stage_layers=(2, 10, 10, 10))
    _, missing = ex.torchtitan_arguments(odd, ex.Launch(nnodes=1, nproc_per_node=8))
    assert "--parallelism.pipeline_parallel_first_stage_less_layers" not in _flags(odd)
    assert any(m.startswith("stage_layers=(2, 10, 10, 10)") for m in missing)


def _flags(cfg: wb.Config) -> dict[str, str]:
    args, _ = ex.torchtitan_arguments(cfg, ex.Launch(nnodes=1, nproc_per_node=8))
    return {key: args[i + 1] for i, key in enumerate(args[:-1]) if key.startswith("--")}


def test_the_torchtitan_launch_states_cp_and_hsdp_and_what_it_cannot():
    # torchtitan itself parses these in tests/test_export_torchtitan.py (where it is installed).
    cfg = wb.Config(model=wb.ModelConfig.preset("8b"), dp=8, cp=2, zero=3, dp_replicate=2, precision="bf16",
                    seq_len=8192, batch_size=16)
    args, missing = ex.torchtitan_arguments(cfg, ex.Launch(nnodes=2, nproc_per_node=8, steps=100))
    flags = dict(zip(args[:-1:2], args[1::2]))  # --key value pairs up to the betas
    assert args[:4] == ["--module", "llama3", "--config", "llama3_8b"]
    assert flags["--parallelism.data_parallel_replicate_degree"] == "2"
    assert flags["--parallelism.data_parallel_shard_degree"] == "4"
    assert flags["--parallelism.context_parallel_degree"] == "2" and flags["--training.seq_len"] == "8192"
    assert args[-1] == "activation-checkpoint:none"
    assert not any("cp=" in m for m in missing)  # zero 3 shards over dp_shard·cp there as here
    _, missing = ex.torchtitan_arguments(wb.Config(dp=2, cp=2, seq_len=256), ex.Launch(nnodes=1, nproc_per_node=4))
    assert any(m.startswith("zero=0 with cp=2") for m in missing)
    toml, _ = ex.torchtitan_toml(cfg, ex.Launch(nnodes=2, nproc_per_node=8))
    job = tomllib.loads(toml)["parallelism"]
    assert (job["data_parallel_replicate_degree"], job["data_parallel_shard_degree"],
            job["context_parallel_degree"]) == (2, 4, 2)
