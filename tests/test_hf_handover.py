"""The hand-over: an export as transformers and lm-eval read it without our code. Its tokenizer
files give `AutoTokenizer.from_pretrained(DIR)` our ids and our end-of-document eos for every
backbone (and for a run trained on a Hugging Face tokenizer); a weights file larger than
--max-shard-size is written in shards with an index that from_pretrained reads, to the same
log-probs; --dtype bf16 writes the weights cast; and lm-eval's stock `hf` model on a copy-off
export gives our adapter's scores on the shipped tasks (log-likelihoods and rolling perplexity)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_hf import QWEN3, TEST_TOKENIZER_IDS

EXPORTS = {"llama": ["copy.enabled=false"], "gpt2": ["copy.enabled=false", "model.arch=gpt2"],
           "qwen3": ["copy.enabled=false", *QWEN3], "qwen3-copy-on": QWEN3}  # copy on: model_type our remote class's
EDGES = ["  two leading spaces\n\tand a tab\r\n", "x = 12345 + 0.5  # digits\n\n\n", "unicode: é ✓ 😀 中文",
         "an <eod> and <s> written out", "", " "]
TRAINED = ["model.vocab_size=512", "model.max_seq_len=128", "data.seq_length=64"]  # the shared `trained` run's shapes
LIMIT = 4


def _texts(small_data) -> list[str]:
    return [*small_data.documents["code"][:3], *small_data.documents["copy"][:3], *EDGES]


def _export_tokenizer(directory: Path, overrides: list[str], files: dict, backend: str = "sentencepiece") -> dict:
    """An export's configs and tokenizer files, as tools/export_hf.py writes them (no weights:
    AutoTokenizer reads config.json's model_type and the tokenizer files only)."""
    from cplm_dist.interop.hf.directory import write_configs
    from cplm_dist.interop.hf.tokenizer_files import write_tokenizer_files

    cfg = load_config("tiny", overrides)
    directory.mkdir()
    tokens = write_tokenizer_files(files, backend, directory, cfg.model.max_seq_len)
    write_configs(cfg.model, cfg.copy, directory, torch.float32, tokens=tokens)
    return tokens


def _assert_same_tokenizer(directory: Path, ours, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)  # no remote code, whatever model_type config.json names
    assert type(tok).__name__ == "TokenizersBackend", (directory.name, type(tok))
    want = [ours.encode(t) for t in texts]
    assert tok(texts)["input_ids"] == want, directory.name  # add_special_tokens on (the default): nothing added
    assert [tok.encode(t) for t in texts] == want, directory.name
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (ours.eod, ours.eod, None if ours.pad < 0 else ours.pad)
    assert len(tok) == ours.vocab_size, directory.name
    for text, ids in zip(texts, want):
        assert tok.decode(ids) == text and tok.decode(ids + [ours.eod], skip_special_tokens=True) == text, directory.name


def test_every_backbones_export_gives_our_token_ids_and_eos(small_data, tmp_path):
    from cplm_dist.data.tokenizer import load_tokenizer

    ours, texts = load_tokenizer(small_data.tokenizer), _texts(small_data)
    for name, overrides in EXPORTS.items():
        tokens = _export_tokenizer(tmp_path / name, overrides, {"tokenizer.model": small_data.tokenizer})
        assert tokens == TEST_TOKENIZER_IDS
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert {k: config[k] for k in tokens} == tokens
        assert sorted(p.name for p in (tmp_path / name).glob("tokenizer*")) == ["tokenizer.json", "tokenizer.model",
                                                                               "tokenizer_config.json"]
        _assert_same_tokenizer(tmp_path / name, ours, texts)


def test_a_hugging_face_tokenizers_export_gives_its_ids_without_its_post_processor(small_data, tmp_path):
    """A run trained on a tokenizer.json whose post-processor puts <s> before every text (as
    Llama 3's does): training's ids had none, so the export's tokenizer adds none; its chat
    template and its own eos / pad are kept."""
    from tokenizers import processors

    from cplm_dist.data.tokenizer import load_tokenizer
    from cplm_dist.interop.hf.tokenizer_files import sentencepiece_to_fast

    source = tmp_path / "source"
    source.mkdir()
    fast = sentencepiece_to_fast(small_data.tokenizer)
    fast.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eod>", "pad_token": "<pad>", "bos_token": "<s>",
                                                              "chat_template": "{{ messages }}"}))
    ours, texts = load_tokenizer(source, "huggingface"), _texts(small_data)
    assert fast.encode("a b").ids[0] == 1 and ours.encode("a b")[0] != 1  # the source adds <s>; training did not
    files = {name: source / name for name in ("tokenizer.json", "tokenizer_config.json")}
    for name, overrides in EXPORTS.items():
        assert _export_tokenizer(tmp_path / name, overrides, files, "huggingface") == TEST_TOKENIZER_IDS
        _assert_same_tokenizer(tmp_path / name, ours, [t for t in texts if "<" not in t])
        assert json.loads((tmp_path / name / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages }}"


def test_max_shard_size_is_a_size_or_one_line(tmp_path, capsys):
    from cplm_dist.interop.hf.directory import parse_size
    from cplm_dist_tools.export_hf import main

    assert [parse_size(s) for s in ("5GB", "500mb", "1.5KB", "100", "2 TB")] == [5 * 10**9, 500 * 10**6, 1500, 100, 2 * 10**12]
    for bad in ("5XB", "GB", "0", "-1GB", ""):
        assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), f"--max-shard-size={bad}"]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith(f"error: --max-shard-size {bad!r} is not a size") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


# --- a copy-off export of the shared run's backbone: shards, bf16, and lm-eval's `hf` model ----------


def _our_lm(adapter):
    """Our HarnessAdapter behind lm-eval's LM interface, in this process (what the `cplm` model
    does for a checkpoint; here the model is in memory)."""
    from lm_eval.api.model import LM

    class Ours(LM):
        def loglikelihood(self, requests):
            return adapter.loglikelihood(requests)

        def loglikelihood_rolling(self, requests):
            return adapter.loglikelihood_rolling(requests)

        def generate_until(self, requests):
            return adapter.generate_until(requests)

    return Ours()


def _evaluate(model, tasks, task_manager) -> dict:
    """{task: (metrics, every request's log-likelihood)} of lm-eval on the shipped tasks."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=model, tasks=tasks, limit=LIMIT, task_manager=task_manager, log_samples=True,
                          bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    scores = {}
    for task in tasks:
        metrics = {k: v for k, v in out["results"][task].items() if isinstance(v, float) and "stderr" not in k}
        logliks = [float(r[0]) if isinstance(r, (list, tuple)) else float(r)
                   for s in out["samples"][task] for r in (x[0] for x in s["resps"])]
        scores[task] = (metrics, logliks)
    return scores


def _handover_worker(trained, tokenizer, directory):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.lm_eval_adapter import HarnessAdapter
    from cplm_dist.data.tokenizer import load_tokenizer
    from cplm_dist.interop.init_from import initialise_from
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import full_state_dict
    from cplm_dist_tools.export_hf import export_model

    init_distributed(1)
    cfg = load_config("tiny", [*TRAINED, "copy.enabled=false", f"model.init_from={trained}", f"data.tokenizer={tokenizer}"])
    model = build_model(cfg)
    initialise_from(model, cfg, 0, 1)
    model.eval()
    out = {}
    for name, dtype, shard in (("sharded", "fp32", 100_000), ("bf16", "bf16", 5 * 10**9)):
        export_model(model, cfg, Path(directory) / name, dtype, shard, {"checkpoint": str(trained)})
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    out["ids"], out["logprobs"] = ids, model.next_token_logprobs(ids)
    out["weights"] = full_state_dict([model.state_dict()], model)
    if importlib.util.find_spec("accelerate") is None:  # lm-eval's hf model imports it (lm-eval[hf])
        return out
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from cplm_dist.evaluation.harness_tasks import TASKS_DIR

    tasks, manager = ["cplm_kv_mc", "cplm_corpus_ppl"], TaskManager(include_path=str(TASKS_DIR))
    out["ours"] = _evaluate(_our_lm(HarnessAdapter(model, load_tokenizer(tokenizer), batch_size=4)), tasks, manager)
    hf = HFLM(pretrained=str(Path(directory) / "sharded"), device="cpu", dtype="float32", batch_size=4)
    out["hf"] = _evaluate(hf, tasks, manager)
    return out


@pytest.fixture(scope="module")
def handed_over(trained, small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("handover")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_ranks(_handover_worker, 1, args=(str(trained), str(small_data.tokenizer), str(root)), env=env)[0], root


def test_a_sharded_export_loads_with_our_log_probs_and_bf16_is_the_weights_cast(handed_over):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from cplm_dist.config.backbones import backbone

    r, root = handed_over
    sharded = root / "sharded"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards and index["metadata"]["total_size"] > 100_000
    for shard in shards:  # each at most 100 kB, or one tensor larger than that alone
        tensors = load_file(str(sharded / shard))
        assert sum(t.numel() * 4 for t in tensors.values()) <= 100_000 or len(tensors) == 1, shard
    hf = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()  # no remote code
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        got = torch.log_softmax(hf(input_ids=r["ids"]).logits, -1)
    torch.testing.assert_close(got, r["logprobs"], rtol=1e-5, atol=1e-5)
    m = load_config("tiny", [*TRAINED, "copy.enabled=false"]).model
    want = backbone(m).hf.to_hf(r["weights"], m)
    bf16 = load_file(str(root / "bf16" / "model.safetensors"))
    assert json.loads((root / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(bf16) == sorted(want)
    for name, tensor in want.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


def test_lm_evals_stock_hf_model_gives_our_adapters_scores(handed_over):
    pytest.importorskip("accelerate", reason="lm-eval's `hf` model needs accelerate: pip install 'lm-eval[hf]'")
    r, _ = handed_over
    for task, (metrics, logliks) in r["ours"].items():
        hf_metrics, hf_logliks = r["hf"][task]
        assert hf_metrics.keys() == metrics.keys() and metrics, task
        for key, value in metrics.items():
            assert hf_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-4), (task, key)
        assert len(logliks) == len(hf_logliks) >= LIMIT
        assert hf_logliks == pytest.approx(logliks, rel=1e-4, abs=1e-4), task
