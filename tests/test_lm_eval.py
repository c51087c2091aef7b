"""lm-evaluation-harness: the adapter's answers against the model, batched equal to batch 1, every
tensor on the model's device; the real harness (lm-eval 0.4) on the shipped local tasks through
the stock `lm_eval` command and tools/lm_eval_cplm.py, single process and at dp = 2 under
torchrun (the documents split, the same scores); a checkpoint copied elsewhere evaluates there."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.device_guard import HostTensorGuard
from tests.spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent
LIMIT = 6
req = lambda *a: SimpleNamespace(args=a)  # noqa: E731


def _adapter_worker(run_dir):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.data.gpt_data import tokenizer_for
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.bottleneck import measure
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.evaluation.lm_eval_adapter import HarnessAdapter

    init_distributed(1)
    model, cfg, _ = load_model(run_dir)
    tok = tokenizer_for(cfg)
    long_text = "x = y + 1; " * 40  # ~3x the model's 128 positions: scored in windows
    mc = [req("The items again: plon, fa,", c) for c in (" ber", " plon, fa", " x")]  # a question, 3 options
    mc += [req("The kor is", " tam."), req("", "hello"), req("Start: ", long_text)]  # single, empty context, windows
    rolling = [req(long_text), req("a b c " * 5)]
    gen = [req("Items: x, y.", {"until": ["."], "max_gen_toks": 6}), req("Items: p, q.", {"until": [], "max_gen_toks": 6}),
           req("", {"until": [], "max_gen_toks": 500}),
           req("Items: p, q.", {"until": [], "max_gen_toks": 6, "do_sample": False, "temperature": 1.0})]  # greedy
    out = {}
    for size in (1, 4):
        adapter = HarnessAdapter(model, tok, batch_size=size)
        with HostTensorGuard() as guard:
            out[size] = {"ll": adapter.loglikelihood(mc), "rolling": adapter.loglikelihood_rolling(rolling),
                         "gen": adapter.generate_until(gen)}
            if size == 4:  # the other evaluation paths, under the same guard
                generate(model, torch.tensor([[5, 6, 7]], device=adapter.device), 3, temperature=1.0, top_k=4, mark_copies=True)
                ids = torch.randint(4, 500, (1, 17), device=adapter.device)
                measure(model, ids[:, :-1], ids[:, 1:])
        out[size]["violations"] = guard.violations
    sampled = [req("Items: p, q.", {"until": [], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0})]
    adapter = HarnessAdapter(model, tok, seed=3)
    out["sampled"] = adapter.generate_until(sampled) + adapter.generate_until(sampled)  # the generator goes on
    out["sampled_again"] = HarnessAdapter(model, tok, seed=3).generate_until(sampled)
    with HostTensorGuard() as guard:  # the guard itself: a prompt made on the host fails on a GPU model
        model.next_token_logprobs(torch.tensor([[5, 6, 7]]))
    out["control"] = guard.violations
    # by hand: the pair encoded as lm-eval's own models do, scored from the full distribution
    ctx, cont = HarnessAdapter(model, tok).encode_pair("The items again: plon, fa,", " plon, fa")
    lp = model.next_token_logprobs(torch.tensor([ctx + cont[:-1]]))[0]
    out["by_hand"] = sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    out["by_hand_greedy"] = all(int(lp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))
    ids = [tok.eod] + tok.encode(long_text)
    by_hand = 0.0
    for start in range(1, len(ids), 128):  # windows of 128 predicted tokens, each with up to 128 before it
        end = min(len(ids), start + 128)
        window = ids[max(0, end - 129):end]
        lp = model.next_token_logprobs(torch.tensor([window[:-1]]))[0]
        by_hand += float(lp[-(end - start):].gather(-1, torch.tensor(window[-(end - start):])[:, None]).sum())
    out["rolling_by_hand"], out["long_tokens"] = by_hand, len(ids)
    return out


def test_adapter_batched_equals_batch_one_and_the_model(trained):
    r = run_ranks(_adapter_worker, 1, args=(str(trained),))[0]
    one, four = r[1], r[4]
    assert r["long_tokens"] > 2 * 128
    assert one["ll"][1][0] == pytest.approx(r["by_hand"], rel=1e-5) and one["ll"][1][1] == r["by_hand_greedy"]
    assert one["rolling"][0] == pytest.approx(r["rolling_by_hand"], rel=1e-5)
    for (a, ga), (b, gb) in zip(one["ll"], four["ll"]):  # shared context + KV cache, padded rows, windows
        assert math.isfinite(a) and a < 0 and a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb
    assert four["rolling"] == pytest.approx(one["rolling"], rel=1e-5)
    assert four["gen"] == one["gen"] and len(one["gen"]) == 4 and "." not in one["gen"][0]
    assert one["gen"][3] == one["gen"][1]  # do_sample=False decodes greedily whatever the temperature
    # a sampled request asked again draws new tokens; the same seed draws the same ones
    assert r["sampled"][0] != r["sampled"][1] and r["sampled_again"] == r["sampled"][:1], r["sampled"]
    assert one["violations"] == [] and four["violations"] == [], one["violations"] + four["violations"]
    assert r["control"] and "embedding" in r["control"][0]


# --- the real harness --------------------------------------------------------------------------------

TASKS = ["cplm_kv_mc", "cplm_list_mc", "cplm_phonebook_gen", "cplm_corpus_ppl"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _results(out_dir: Path) -> dict:
    files = sorted(out_dir.rglob("results_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _metrics(results: dict) -> dict:
    return {(task, k): v for task in TASKS for k, v in results["results"][task].items()
            if isinstance(v, float) and "stderr" not in k}


@pytest.fixture(scope="module")
def copied(trained, tmp_path_factory):
    """The run copied to another directory, its config pointing the tokenizer at a relative path
    that exists nowhere (as when training ran elsewhere): it must evaluate from the copy alone."""
    dest = tmp_path_factory.mktemp("moved") / "run"
    shutil.copytree(trained, dest)
    for manifest in dest.glob("checkpoints/step-*/complete.json"):
        m = json.loads(manifest.read_text())
        m["config"]["data"]["tokenizer"] = "data/quickstart/tokenizer.model"
        m.pop("cwd", None)
        manifest.write_text(json.dumps(m))
    return dest


@pytest.fixture(scope="module")
def stock_cli(copied, tmp_path_factory):
    """The stock `lm_eval` command at batch 1 (model_args' batch_size over --batch_size), run from a
    directory that is neither the repository nor where the checkpoint is."""
    from cplm_dist.evaluation.harness_tasks import TASKS_DIR

    where = tmp_path_factory.mktemp("elsewhere")
    out = where / "results"
    proc = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "run", "--model", "cplm", "--model_args",
                           f"checkpoint={copied},batch_size=1", "--tasks", "cplm_local", "--include_path", str(TASKS_DIR),
                           "--batch_size", "8", "--limit", str(LIMIT), "--output_path", str(out)],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=where)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return _results(out), proc


def test_stock_lm_eval_command_runs_the_local_tasks_on_a_moved_checkpoint(stock_cli):
    results, proc = stock_cli
    assert "cplm: dp rank 0 of 1 answers" in proc.stderr and "(batch size 1)" in proc.stderr  # model_args win
    metrics = _metrics(results)
    for task in ("cplm_kv_mc", "cplm_list_mc"):
        assert 0 <= metrics[(task, "acc,none")] <= 1
    assert 0 <= metrics[("cplm_phonebook_gen", "exact_match,strip")] <= 1
    assert metrics[("cplm_corpus_ppl", "bits_per_byte,none")] > 0
    assert results["n-samples"]["cplm_kv_mc"]["effective"] == LIMIT


def test_tool_with_batching_gives_the_stock_commands_scores(stock_cli, copied, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "tools/lm_eval_cplm.py"), "--checkpoint", str(copied),
                           "--tasks", *TASKS, "--batch-size", "8", "--limit", str(LIMIT), "--log-samples",
                           "--output-path", str(out)], capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "(batch size 8)" in proc.stderr
    mine, stock = _metrics(_results(out)), _metrics(stock_cli[0])
    assert mine.keys() == stock.keys()
    for key, value in stock.items():
        assert mine[key] == pytest.approx(value, rel=1e-5), key
    for task in TASKS:  # --log-samples: every document with its answers
        (samples,) = out.rglob(f"samples_{task}_*.jsonl")
        assert len(samples.read_text().splitlines()) == LIMIT


def test_tool_at_dp2_splits_the_documents_and_gives_the_same_scores(stock_cli, copied, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tools/lm_eval_cplm.py"), "--checkpoint", str(copied), "--tasks", "cplm_kv_mc",
                           "cplm_corpus_ppl", "--batch-size", "4", "--limit", str(LIMIT), "--output-path", str(out)],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # lm-eval gives each dp rank half the documents: 3 questions x 4 options, and 3 texts
    for rank in (0, 1):
        assert f"cplm: dp rank {rank} of 2 answers 12 loglikelihood requests" in proc.stderr, proc.stderr[-3000:]
        assert f"cplm: dp rank {rank} of 2 answers 3 loglikelihood_rolling requests" in proc.stderr
    results, stock = _results(out), _metrics(stock_cli[0])
    for task in ("cplm_kv_mc", "cplm_corpus_ppl"):
        for key, value in results["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert value == pytest.approx(stock[(task, key)], rel=1e-5), (task, key)


def test_tool_at_tp2_runs_one_replica_over_both_ranks(stock_cli, copied, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tools/lm_eval_cplm.py"), "--checkpoint", str(copied), "--tasks", "cplm_kv_mc",
                           "--model-args", "tp=2", "--batch-size", "4", "--limit", str(LIMIT), "--output-path", str(out)],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # one replica: every request on both ranks (announced once, by its first tp rank), one results file
    assert proc.stderr.count("cplm: dp rank 0 of 1 answers 24 loglikelihood requests") == 1, proc.stderr[-3000:]
    assert "dp rank 1" not in proc.stderr
    acc = _results(out)["results"]["cplm_kv_mc"]["acc,none"]
    assert acc == pytest.approx(_metrics(stock_cli[0])[("cplm_kv_mc", "acc,none")], abs=1e-9)


def test_tool_refuses_unknown_tasks_and_bad_flags_before_loading_the_model(trained, tmp_path, capsys, monkeypatch):
    import torch.distributed as dist

    from cplm_dist_tools.lm_eval_cplm import main

    # the launch of four ranks at tp 1 (the checkpoint's) has 4 replicas; at tp 2, 2
    for env, args, message in (({"WORLD_SIZE": "4"}, ["--limit", "3"], "--limit 3 is below the 4 data-parallel replicas"),
                               ({"WORLD_SIZE": "4"}, ["--limit", "1", "--model-args", "tp=2"], "--limit 1 is below the 2"),
                               ({"WORLD_SIZE": "4"}, ["--limit", "2", "--model-args", "tp=3"], "tp=3 does not divide")):
        with monkeypatch.context() as m:
            for key, value in {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}.items():
                m.setenv(key, value)
            assert main(["--checkpoint", str(trained), "--tasks", "cplm_kv_mc", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    for args, message in ((["--tasks", "cplm_kv_mc", "no_such_task"], "unknown task(s) no_such_task"),
                          (["--tasks", "cplm_kv_mc", "--log-samples"], "--log-samples needs --output-path"),
                          (["--tasks", "cplm_kv_mc", "--batch-size", "0"], "--batch-size"),
                          (["--tasks", "cplm_kv_mc", "--limit", "0"], "--limit 0"),
                          (["--tasks", "cplm_kv_mc", "--checkpoint", str(tmp_path)], "no complete checkpoint there")):
        assert main(["--checkpoint", str(trained), *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not dist.is_initialized()  # refused before anything loaded


def test_register_twice_and_the_plugin_finds_the_model():
    code = ("from lm_eval.api.registry import get_model; c = get_model('cplm'); "
            "from cplm_dist.evaluation.harness_model import register, CPLMHarnessModel; register(); register(); "
            "assert get_model('cplm') is c is CPLMHarnessModel; "
            "import importlib.resources as r; assert len(list(r.files('lm_eval.models').iterdir())) > 10; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    off = subprocess.run([sys.executable, "-c", "from lm_eval.api.registry import get_model; get_model('cplm')"],
                         capture_output=True, text=True, timeout=120, env={**_env(), "CPLM_NO_LM_EVAL_PLUGIN": "1"})
    assert off.returncode != 0 and "no model for this name found" in off.stderr


def test_checkpoint_carries_its_tokenizer(small_data, copied):
    from cplm_dist.checkpoint import load_checkpoint_config
    from cplm_dist.files import sha256_file

    cfg, info = load_checkpoint_config(copied)
    assert Path(cfg.data.tokenizer) == copied / "checkpoints" / info["tag"] / "tokenizer.model"
    assert sha256_file(cfg.data.tokenizer) == sha256_file(small_data.tokenizer)
    assert "tokenizer.model" in info["files"]  # hashed with the weights
