"""Real tokenizers and local corpora (issue 32, item 5): a tokenizer.json or Hugging Face tokenizer folder named by
Config.tokenizer, text / JSON Lines / Parquet files, tokenised once into the data cache.

Every tokenizer here is trained in the test with the `tokenizers` library on text the test writes: nothing is
downloaded. The byte tokenizer's own tests (tests/engine/test_data.py) are unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import workbench as wb
from tests.engine.rank_fns import reference_run
from workbench.config.tokenizer import tokenizer_info
from workbench.corpus import Corpus, check_corpus
from workbench.engine.data import TokenData
from workbench.shards import prepare
from workbench.tokens import SEPARATOR

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the model trains on tokens of text that a tokenizer made from words like these and more words of "
         "its own with numbers 0 1 2 3 and punctuation , . ; : ! ?").split()


def _text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words))


def _train_tokenizer(path: Path, vocab_size: int = 300, eos: str = "<|endoftext|>") -> Path:
    """A byte-level BPE (GPT-2's kind) trained here; saved as a tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_text(i, 200) for i in range(20)], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return _train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _vocab(path: Path) -> int:
    return tokenizer_info(path).vocab_size


def _jsonl(folder: Path, docs: list[str], name: str = "part.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return folder


def _encode(tokenizer: Path, docs: list[str]) -> list[int]:
    """The shard a tokenizer makes of `docs`, written out by hand: each document's ids, then end of text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    return [i for d in docs for i in [*tok.encode(d).ids, eos]]


# -- Config.tokenizer ------------------------------------------------------------------------------------------
def test_the_byte_tokenizer_stays_the_default():
    cfg = wb.Config()
    assert cfg.tokenizer is None and cfg.to_dict()["tokenizer"] is None
    assert wb.Config.from_dict({k: v for k, v in cfg.to_dict().items() if k != "tokenizer"}) == cfg


def test_a_tokenizer_is_stored_as_its_absolute_path_and_round_trips(tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tokenizer.parent)
    model = wb.ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=320)
    for named in ("tokenizer.json", Path("tokenizer.json"), ".", str(tokenizer)):
        cfg = wb.Config(model=model, tokenizer=named)
        assert Path(cfg.tokenizer).is_absolute()
        assert wb.Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    cfg.save(tmp_path / "config.json")
    assert wb.Config.load(tmp_path / "config.json") == cfg


def test_a_vocabulary_larger_than_the_models_is_refused_naming_the_field_and_the_fix(tokenizer):
    n = _vocab(tokenizer)
    assert 256 < n <= 300
    with pytest.raises(wb.ConfigError, match=rf"^tokenizer: .*{n:,} tokens.*model.vocab_size=256.*"
                                             rf"Fix: give the model vocab_size ≥ {n}"):
        wb.Config(tokenizer=tokenizer)
    fits = wb.Config(model=wb.ModelConfig(vocab_size=n), tokenizer=tokenizer)
    assert fits.model.vocab_size == n


def test_a_tokenizer_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(wb.ConfigError, match=rf"^tokenizer: {tmp_path / 'none.json'} does not exist"):
        wb.Config(tokenizer=tmp_path / "none.json")
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "vocab.json").write_text("{}")
    (slow / "merges.txt").write_text("")
    with pytest.raises(wb.ConfigError, match=r"holds no tokenizer.json \(it has merges.txt, vocab.json.*"
                                             r"Fix: convert it once with transformers"):
        wb.Config(tokenizer=slow)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(wb.ConfigError, match="^tokenizer: .*bad.json is not a tokenizer"):
        wb.Config(tokenizer=tmp_path / "bad.json")
    with pytest.raises(wb.ConfigError, match="^tokenizer: expected a path"):
        wb.Config(tokenizer=3)


def test_a_hugging_face_folder_names_its_end_of_text(tmp_path):
    """A folder whose tokenizer_config.json says eos_token is "</s>": that one ends documents, not <|endoftext|>."""
    folder = tmp_path / "hf"
    path = _train_tokenizer(folder / "tokenizer.json")
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.save(str(path))
    assert tokenizer_info(folder).eos_id == tok.token_to_id("<|endoftext|>")  # no config: the first known name
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    info = tokenizer_info(folder)
    assert info.eos_id == tok.token_to_id("</s>") and info.path == path.resolve()
    assert info.vocab_size == tok.get_vocab_size(with_added_tokens=True) and info.dtype == "uint16"


# -- documents and the shard ----------------------------------------------------------------------------------
def test_a_tokenised_text_folder_is_each_files_ids_then_end_of_text(tokenizer, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    docs = [_text(i, 300) for i in range(3)]
    for i, d in enumerate(docs):
        (folder / f"{i}.txt").write_text(d)
    (folder / "blob.bin").write_bytes(b"\x00\x01")
    shard = prepare(folder, tmp_path / "cache", tokenizer=tokenizer)
    m = shard.manifest
    assert shard.tokens().dtype == np.uint16 and shard.tokens().tolist() == _encode(tokenizer, docs)
    assert (m.files, m.documents, m.skipped, m.tokens, m.dtype) == (3, 3, 1, len(shard.tokens()), "uint16")
    assert m.tokenizer == str(tokenizer.resolve()) and m.separator == tokenizer_info(tokenizer).eos_id
    assert m.tokens < sum(len(d) for d in docs) / 2, "a trained BPE packs several bytes a token"


def test_jsonl_and_parquet_records_are_documents_in_bytes_and_in_tokens(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs pyarrow (the parquet extra)")
    import pyarrow as pa

    docs = [_text(i, 40) + " é" for i in range(10)]
    folder = _jsonl(tmp_path / "corpus", docs[:6], "a.jsonl")
    pq.write_table(pa.table({"text": docs[6:], "n": list(range(4))}), folder / "b.parquet", row_group_size=2)
    as_bytes = prepare(folder, tmp_path / "cache")
    sep = bytes([SEPARATOR])
    assert as_bytes.path.read_bytes() == b"".join(d.encode() + sep for d in docs)
    assert (as_bytes.manifest.files, as_bytes.manifest.documents) == (2, 10)
    as_ids = prepare(folder, tmp_path / "cache", tokenizer=tokenizer)
    assert as_ids.path != as_bytes.path and as_ids.tokens().tolist() == _encode(tokenizer, docs)


def test_a_shard_is_rebuilt_when_the_tokenizer_changes(tokenizer, tmp_path):
    folder = _jsonl(tmp_path / "corpus", [_text(i, 50) for i in range(4)])
    other = _train_tokenizer(tmp_path / "other" / "tokenizer.json", vocab_size=270)
    first = prepare(folder, tmp_path / "cache", tokenizer=tokenizer)
    assert prepare(folder, tmp_path / "cache", tokenizer=tokenizer) == first
    second = prepare(folder, tmp_path / "cache", tokenizer=other)
    assert second.path != first.path and second.manifest.tokenizer_sha256 != first.manifest.tokenizer_sha256
    assert len(second.tokens()) > len(first.tokens()), "fewer merges, more tokens"


def test_finding_a_shard_never_builds_one(tokenizer, tmp_path):
    """What a Workbench looks for while its ranks start (`build=False`): the shard when it is built and current."""
    folder = _jsonl(tmp_path / "corpus", [_text(i, 50) for i in range(4)])
    assert prepare(folder, tmp_path / "cache", build=False) is None
    assert not (tmp_path / "cache").exists()
    built = prepare(folder, tmp_path / "cache")
    assert prepare(folder, tmp_path / "cache", build=False) == built
    assert prepare(folder, tmp_path / "cache", tokenizer=tokenizer, build=False) is None, "another tokenizer's"
    (folder / "more.jsonl").write_text(json.dumps({"text": _text(9, 50)}) + "\n")
    assert prepare(folder, tmp_path / "cache", build=False) is None, "the folder changed: no longer current"


def test_building_shows_a_progress_bar(tokenizer, tmp_path, capsys):
    folder = _jsonl(tmp_path / "corpus", [_text(i, 50) for i in range(4)])
    prepare(folder, tmp_path / "cache", tokenizer=tokenizer, progress=True)
    assert "tokenising with" in capsys.readouterr().err
    prepare(folder, tmp_path / "cache", tokenizer=tokenizer, progress=True)
    assert capsys.readouterr().err == "", "a shard already built shows nothing"


def test_batches_are_windows_of_the_ids(tokenizer, tmp_path):
    folder = _jsonl(tmp_path / "corpus", [_text(i, 400) for i in range(20)])
    cfg = wb.Config(model=wb.ModelConfig(vocab_size=320), tokenizer=tokenizer, batch_size=4, seq_len=32)
    data = TokenData.for_config(cfg, folder, cache_dir=tmp_path / "cache")
    ids = data.shard.tokens()
    batch = data.global_batch(3)
    assert batch.dtype == torch.int64 and int(batch.max()) < _vocab(tokenizer)
    for row, offset in zip(batch, data.offsets(3), strict=True):
        assert row.tolist() == ids[offset:offset + 33].tolist()
    assert "tokens of" in repr(data)


def test_records_without_their_text_are_refused_before_any_rank(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "x.jsonl").write_text(json.dumps({"content": "hi"}) + "\n")
    with pytest.raises(wb.ConfigError, match=r"^corpus: .*x.jsonl, line 1: no string 'text' field \(it has "
                                             r"\['content'\]\). Fix: put each document's text under 'text'"):
        check_corpus(folder)
    (folder / "x.jsonl").write_text("{oops\n")
    with pytest.raises(wb.ConfigError, match="line 1: not JSON"):
        check_corpus(folder)
    (folder / "x.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    check_corpus(folder)


def test_parquet_without_its_text_column_is_refused(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs pyarrow (the parquet extra)")
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "x.parquet")
    with pytest.raises(wb.ConfigError, match=r"no 'text' column \(it has \['body'\]\)"):
        check_corpus(tmp_path / "x.parquet")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(wb.ConfigError, match="needs pyarrow.*Fix: pip install pyarrow"):
        check_corpus(tmp_path)


@pytest.mark.processes
def test_prepare_script_takes_a_tokenizer(tokenizer, tmp_path):
    folder = _jsonl(tmp_path / "corpus", [_text(i, 50) for i in range(4)])
    result = subprocess.run([sys.executable, str(REPO / "data" / "prepare.py"), "--source", str(folder),
                             "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(_encode(tokenizer, [_text(i, 50) for i in range(4)])):,} tokens" in result.stdout


# -- export ----------------------------------------------------------------------------------------------------
def test_export_carries_the_tokenizer_and_the_corpus(tokenizer, tmp_path):
    from workbench import export as ex

    cfg = wb.Config(model=wb.ModelConfig(vocab_size=320), tokenizer=tokenizer, dp=2)
    out = ex.export(cfg, tmp_path / "run", gpus_per_node=2, corpus=str(tmp_path / "corpus"))
    assert wb.Config.load(out.files["config"]) == cfg
    assert f"--corpus {tmp_path / 'corpus'}" in out.files["torchrun"].read_text()
    args, missing = ex.torchtitan_arguments(cfg, ex.Launch(nnodes=1, nproc_per_node=2))
    assert args[args.index("--hf_assets_path") + 1] == str(tokenizer.parent)
    assert not any("byte-level" in m for m in missing) and any("corpus" in m for m in missing)
    toml, _ = ex.torchtitan_toml(cfg, ex.Launch(nnodes=1, nproc_per_node=2))
    assert f'hf_assets_path = "{tokenizer.parent}"' in toml


# -- on the ranks ------------------------------------------------------------------------------------------------
@pytest.fixture
def jsonl_corpus(tmp_path):
    folder = _jsonl(tmp_path / "corpus", [_text(i, 300) for i in range(40)])
    yield folder
    from workbench.shards import default_cache_dir

    for shard in default_cache_dir().glob(Corpus.resolve(folder).cache_key() + "*"):  # the ranks' cache: tidy it
        shard.unlink()


def test_a_pool_trains_on_a_tokenised_jsonl_corpus_as_one_process_does(pool, tokenizer, jsonl_corpus):
    """dp=2 on the tokenizer's ids of a JSONL corpus: the losses of one process on the same batches (fp32, 1e-5)."""
    cfg = wb.Config(model=wb.ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=320), tokenizer=tokenizer,
                    batch_size=4, seq_len=32, dp=2)
    with wb.Workbench(pool=pool, corpus=jsonl_corpus) as bench:
        bench.apply(cfg, fresh=True)
        losses = [m.loss for m in bench.train(4).wait()]
    data = TokenData.for_config(cfg, jsonl_corpus)
    assert data.shard.manifest.tokenizer == str(tokenizer.resolve())
    assert losses == pytest.approx(reference_run(cfg, 4, data)["losses"], rel=1e-5)
    assert losses[-1] < losses[0]
