"""A model of one's own leaves the notebook: config.json carries it, python -m workbench.train builds it under
torchrun, and the torchtitan export says what it cannot express."""

from __future__ import annotations

import json

import workbench as wb
from workbench.export import Launch, export
from workbench.export_torchtitan import _titan_layout

from tests.models.custom_models import PLAN
from tests.models.families import family
from tests.test_train_torchrun import _losses, _srun_tasks


def test_the_exported_run_trains_the_same_hugging_face_model_as_the_notebook(pool, tmp_path):
    # Its ranks started as a Slurm job's srun starts them: torchrun's launch of the exported run.sh is
    # tests/test_train_torchrun.py's; what differs here is the model each rank builds from config.json.
    cfg = wb.Config(model=family("qwen3"), tp=2, batch_size=4, seq_len=16, seed=1)
    run = tmp_path / "run"
    export(cfg, run, Launch(nnodes=2, nproc_per_node=1, device="cpu", steps=3))
    assert wb.Config.load(run / "config.json") == cfg  # the source, its whole transformers config, round-trips
    assert json.loads((run / "config.json").read_text())["model"]["source"] == "huggingface"
    outputs = _srun_tasks(run / "config.json", "--steps", "3", "--metrics", str(run / "metrics.jsonl"))
    assert "tp2 on 2 rank(s) (gloo, cpu, started by srun)" in outputs[0]
    with wb.Workbench(pool=pool) as bench:
        bench.apply(cfg, fresh=True)
        notebook = [m.loss for m in bench.train(3).wait()]
    torchrun = _losses(run / "metrics.jsonl")
    assert [torchrun[i] for i in range(3)] == notebook  # same layout, same reduction order: bit-identical


def test_the_torchtitan_export_says_plainly_what_it_cannot_express():
    hf = _titan_layout(wb.Config(model=family("qwen3_moe"), dp=2, ep=2, zero=2, batch_size=4, seq_len=16))
    assert any("Hugging Face's qwen3_moe" in m and "not a transformers module" in m for m in hf.missing)
    own = _titan_layout(wb.Config(model=wb.CustomModel("tests.models.custom_models:tiny_gpt", plan=PLAN), pp=2,
                                  micro_batches=2, schedule="interleaved_1f1b", batch_size=4, seq_len=16))
    assert any("your own module (tests.models.custom_models:tiny_gpt)" in m and "TrainSpec" in m for m in own.missing)


def test_every_torchtitan_file_of_a_foreign_model_says_what_it_cannot_express(tmp_path):
    """What the user reads: torchtitan.sh's and torchtitan.toml's notes and the export's summary name the foreign
    model and what runs it instead (run.sh), not only the layout's translation."""
    for cfg in (wb.Config(model=family("llama"), dp=2, batch_size=4, seq_len=16),
                wb.Config(model=wb.CustomModel("tests.models.custom_models:tiny_gpt", plan=PLAN), tp=2, batch_size=4,
                          seq_len=16)):
        out = export(cfg, tmp_path / cfg.model.name.replace(":", "_"), Launch(nnodes=1, nproc_per_node=2))
        said = f"the model is {'your own module' if isinstance(cfg.model, wb.CustomModel) else 'Hugging Face'}"
        for text in (out.files["torchtitan"].read_text(), out.files["torchtitan_toml"].read_text(), str(out)):
            notes = [line for line in text.splitlines() if said in line]
            assert len(notes) == 1 and "python -m workbench.train (run.sh) trains this model" in notes[0], text
