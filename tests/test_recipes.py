"""Recipes in tokens (docs/data.md): train.train_tokens and data.stages[].from_tokens decide the
steps at load; a blend entry may be a glob of dataset parts and be weighed by its tokens, its parts
then counted as one source; a derived config's mixture replaces its base's; a glob blend trains."""

import math

import pytest

from cplm_dist.config import load_config
from cplm_dist.config.curriculum import source_ids, source_names
from cplm_dist.data.blend import budget_lines, dataset_tokens, resolve_blend
from cplm_dist.data.indexed_data import write_indexed_dataset
from cplm_dist.data.sources import iter_documents
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist.errors import ConfigError, DataError
from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks
from tests.test_train import _train, argv

PARTS = 3


@pytest.fixture(scope="module")
def parts(small_data, tmp_path_factory):
    """The small corpus' copy documents written as PARTS dataset parts (data/parts/copy-0000i)."""
    root = tmp_path_factory.mktemp("parts")
    docs = list(iter_documents([small_data.raw["copy"]]))
    tok = load_tokenizer(small_data.tokenizer)
    for i in range(PARTS):
        write_indexed_dataset(docs[i::PARTS], tok, root / f"copy-{i:05d}", progress=False)
    (root / "copy-notes.txt").write_text("not a dataset")  # a glob matches .idx prefixes only
    return root


def test_train_tokens_and_from_tokens_decide_the_steps(capsys):
    """ceil(tokens / (global batch x seq_length)); an explicit different train_steps is ignored, said once."""
    per_step = 8 * 64
    base = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_length=64", "optim.warmup_steps=0"]
    cfg = load_config("tiny", [*base, "train.train_tokens=10000", "train.train_steps=7"])
    assert cfg.train.train_steps == math.ceil(10_000 / per_step) == 20
    assert capsys.readouterr().err.splitlines() == [
        "note: train.train_steps=7 is ignored: train.train_tokens=10,000 decides 20 steps "
        "(ceil(tokens / (train.global_batch_size 8 x data.seq_length 64)))"]
    load_config("tiny", [*base, "train.train_tokens=10000", "train.train_steps=7"])
    assert capsys.readouterr().err == ""  # once per process
    assert load_config("tiny", [*base, "train.train_tokens=10240"]).train.train_steps == 20  # exact: no rounding
    assert capsys.readouterr().err == ""  # no train_steps given: nothing ignored
    stages = "data.stages=[{from_step: 0, blend: [{path: a}]}, {from_tokens: 5000, blend: [{path: b}]}]"
    cfg = load_config("tiny", [*base, "train.train_tokens=10000", "data.blend=[]", stages])
    assert [s.from_step for s in cfg.data.stages] == [0, 10]  # ceil(5000 / 512)
    with pytest.raises(ConfigError, match=r"train.train_tokens=0 must be a positive number of tokens"):
        load_config("tiny", [*base, "train.train_tokens=0"])


def test_a_derived_configs_mixture_replaces_its_bases(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("base: tiny\ndata:\n  blend: [{path: a, weight: 1.0}]\n")
    (tmp_path / "staged.yaml").write_text(
        "base: base.yaml\ntrain:\n  train_steps: 10\noptim:\n  warmup_steps: 0\ndata:\n  stages:\n    - {from_step: 0, blend: [{path: b}]}\n"
        "    - {from_step: 5, blend: [{path: c}]}\n")
    cfg = load_config(tmp_path / "staged.yaml")
    assert cfg.data.blend == [] and [s.blend[0].path for s in cfg.data.stages] == ["b", "c"]
    assert "sets data.stages over the data.blend of its base: the inherited data.blend is dropped" in capsys.readouterr().err
    (tmp_path / "blended.yaml").write_text("base: staged.yaml\ndata:\n  blend: [{path: d}]\n")
    cfg = load_config(tmp_path / "blended.yaml")
    assert cfg.data.stages == [] and [e.path for e in cfg.data.blend] == ["d"]
    (tmp_path / "both.yaml").write_text("base: tiny\ndata:\n  blend: [{path: a}]\n  stages: [{from_step: 0, blend: [{path: b}]}]\n")
    with pytest.raises(ConfigError, match="data.blend and data.stages are both set"):
        load_config(tmp_path / "both.yaml")


def test_a_glob_blend_by_tokens_expands_into_its_parts_as_one_source(small_data, parts):
    code = small_data.prefixes["code"]
    cfg = load_config("tiny", [f"data.blend=[{{path: {parts}/copy-*, weight: tokens}}, {{path: {code}, weight: tokens}}]"])
    resolve_blend(cfg)
    tokens = [dataset_tokens(str(parts / f"copy-{i:05d}")) for i in range(PARTS)]
    assert [(e.path, e.weight, e.source) for e in cfg.data.blend] == [
        *[(str(parts / f"copy-{i:05d}"), float(n), f"{parts}/copy-*") for i, n in enumerate(tokens)],
        (code, float(dataset_tokens(code)), None)]
    before = [(e.path, e.weight, e.source) for e in cfg.data.blend]
    resolve_blend(cfg)  # idempotent: a saved (expanded) config resolves to itself
    assert [(e.path, e.weight, e.source) for e in cfg.data.blend] == before
    assert source_names(cfg) == ["copy-*", "code"] and source_ids(cfg, 0) == [0, 0, 0, 1]
    lines = budget_lines(cfg)
    assert len(lines) == 2 and lines[0].startswith(f"data: copy-*: {sum(tokens):,} tokens in 3 parts, ")
    # a number is split over the parts by their tokens
    cfg = load_config("tiny", [f"data.blend=[{{path: {parts}/copy-*, weight: 0.6}}, {{path: {code}, weight: 0.4}}]"])
    resolve_blend(cfg)
    assert [e.weight for e in cfg.data.blend[:PARTS]] == pytest.approx([0.6 * n / sum(tokens) for n in tokens])
    nothing = load_config("tiny", [f"data.blend=[{{path: {parts}/web-*}}]"])
    with pytest.raises(DataError, match=rf"data.blend\[0\].path={parts}/web-\* matches no dataset"):
        resolve_blend(nothing)


def test_a_glob_blend_weighed_by_tokens_trains_with_metrics_per_entry(small_data, parts, tmp_path):
    out = tmp_path / "run"
    blend = f"data.blend=[{{path: {parts}/copy-*, weight: tokens}}, {{path: {small_data.prefixes['code']}, weight: tokens}}]"
    assert run_ranks(_train, 1, args=(argv(small_data, out, "train.train_steps=2", blend),)) == [0]
    log = read_metrics(out / "logs" / "metrics.jsonl")
    assert sorted(log) == [1, 2] and set(log[2]["sources"]) == {"copy-*", "code"}
