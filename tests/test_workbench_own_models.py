"""The Workbench with a model of one's own: a Hugging Face family applied, trained, resharded and exported from the
notebook; what it cannot run refused before any rank is touched."""

from __future__ import annotations

import json

import pytest

import workbench as wb

from tests.models.families import family
from tests.test_workbench import bench  # noqa: F401 - the Workbench on the session's pool, closed after the test

BASE = dict(batch_size=4, seq_len=16)


def test_a_hugging_face_model_from_the_notebook(bench, tmp_path):
    cfg = wb.Config(model=family("qwen3"), dp=2, zero=3, **BASE)
    bench.apply(cfg, fresh=True)
    first = bench.train(3).wait()
    # Its model FLOPs were traced in the notebook: the ranks measure MFU against them.
    assert all(m.flops > 0 and m.mfu is not None for m in first)
    info = bench.apply(cfg.replace(dp=1, zero=0, tp=2))
    assert info["resharded"] and info["reshard"] == "direct"
    bench.train(2).wait()
    files = bench.export_hf(tmp_path / "out")
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"
    # The export loads back as this run's weights, in another layout: the same next loss as carrying on.
    carried = bench.train(1).wait()[0].loss
    bench.apply(wb.Config(model=wb.HFModel(tmp_path / "out", weights=tmp_path / "out"), pp=2, micro_batches=2,
                          **BASE), fresh=True)
    assert bench.train(1).wait()[0].loss != carried  # a fresh run starts at step 0's batch, not step 5's
    assert bench.config.model.weights == str(tmp_path / "out")


def test_what_the_model_cannot_run_touches_no_rank(bench, monkeypatch, tmp_path):
    bench.apply(wb.Config(model=family("llama"), dp=2, **BASE), fresh=True)
    sent = []
    monkeypatch.setattr(bench.pool, "run_async", lambda *a, **k: sent.append(a))
    monkeypatch.setattr(bench.pool, "run", lambda *a, **k: sent.append(a))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(wb.ConfigError, match="model.weights: .* does not fit the model .*\n  model.embed_tokens"):
        bench.apply(wb.Config(model=wb.HFModel(family("llama").config, weights=tmp_path), dp=2, **BASE))
    with pytest.raises(wb.ConfigError, match="^tp: tp=2 does not divide the key/value heads \\(1\\)"):
        bench.check(wb.Config(model=family("llama", num_key_value_heads=1), tp=2, **BASE))
    from tests.models.custom_models import PLAN

    with pytest.raises(wb.ConfigError, match="^tp: .*h.\\*.attn.q: its 3 heads do not divide tp=2"):
        bench.check(wb.Config(model=wb.CustomModel("tests.models.custom_models:tiny_gpt", plan=PLAN, dim=24, heads=3),
                              tp=2, **BASE))
    with pytest.raises(wb.ConfigError, match="^model: .*no callable 'missing'"):
        bench.apply(wb.Config(model=wb.CustomModel("tests.models.custom_models:missing"), dp=2, **BASE))
    assert sent == [], "a refused config never reaches the ranks"
