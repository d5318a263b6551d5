"""A checkpoint's safetensors: each piece read alone, and a folder that does not fit refused naming every tensor."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.config import Config, ConfigError, HFModel
from workbench.models.build import build
from workbench.models.check import check_model
from workbench.models.init import whole_model
from workbench.models.weights import index, problems, write

from tests.models.families import family, hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Qwen3 checkpoint as transformers itself writes one (save_pretrained: safetensors + config.json), in bf16."""
    folder = tmp_path_factory.mktemp("qwen3")
    model = hf_model(Config(model=family("qwen3"), seq_len=16)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def test_each_rank_reads_its_piece_of_a_transformers_checkpoint(saved):
    folder, tensors = saved
    source = HFModel(folder, weights=folder)
    assert source.weights == str(folder) and source.model_type == "qwen3"
    built = build(source, seed=0)
    name = "model.layers.1.mlp.down_proj.weight"  # (32, 64): rows 0..15, columns 32..63 and 8..15
    region = (((0, 16),), ((32, 64), (8, 16)))
    (got_name, piece), = built.values.pieces({name: region})
    assert got_name == name and piece.dtype == torch.bfloat16
    assert torch.equal(piece, torch.cat([tensors[name][:16, 32:64], tensors[name][:16, 8:16]], dim=1))
    whole = whole_model(built.model, built.values)
    assert all(torch.equal(whole[k], tensors[k]) for k in whole)  # bf16 widens exactly into the fp32 model
    check_model(Config(model=source, tp=2, seq_len=16))


def test_a_folder_that_does_not_fit_is_refused_naming_each_tensor(saved, tmp_path):
    folder, tensors = saved
    broken = dict(tensors)
    del broken["model.layers.0.self_attn.q_proj.weight"]
    broken["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    broken["model.norm.weight"] = torch.zeros(33)
    broken["model.embed_tokens.weight"] = broken["model.embed_tokens.weight"].to(torch.int32)
    config = json.loads((folder / "config.json").read_text())
    write(tmp_path, broken, config)
    entries = index(tmp_path)
    model = build(HFModel(tmp_path), seed=0).model
    found = problems(entries, {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()})
    assert found == [
        "model.layers.0.self_attn.q_proj.weight: missing from the checkpoint (the model has it, shape (32, 32))",
        "model.layers.9.mlp.up_proj.weight: in the checkpoint, not in the model",
        "model.embed_tokens.weight: stored as I32, which does not convert exactly to the model's torch.float32",
        "model.norm.weight: shape (33,) in the checkpoint, (32,) in the model",
    ]
    with pytest.raises(ConfigError, match="model.weights: .* does not fit the model \\(qwen3\\):\n  model.layers.0"):
        check_model(Config(model=HFModel(tmp_path, weights=tmp_path), seq_len=16))


def test_written_shards_and_their_index_read_back(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each, 2 a shard
    files = write(tmp_path, tensors, {"model_type": "llama"}, max_shard_bytes=2048)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json", "config.json"]
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {"t0": "model-00001-of-00003.safetensors", "t1": "model-00001-of-00003.safetensors",
                          "t2": "model-00002-of-00003.safetensors", "t3": "model-00002-of-00003.safetensors",
                          "t4": "model-00003-of-00003.safetensors"}
    assert {name: entry.shape for name, entry in index(tmp_path).items()} == {f"t{i}": (256,) for i in range(5)}
    with pytest.raises(ConfigError, match="model.weights: weights folder .*nowhere' does not exist"):
        HFModel(family("llama").config, weights=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model.weights: .*empty holds no .safetensors file"):
        HFModel(family("llama").config, weights=tmp_path / "empty")
