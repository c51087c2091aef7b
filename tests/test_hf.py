"""Checkpoints beyond one layout and beyond this project: a checkpoint loads at any tp; a random
transformers Llama imports at tp 1 and 2 with its own logits; a copy-off run exported with
tools/export_hf.py is a stock LlamaForCausalLM with our log-probs; `model.init_from` starts a
training run from a HF directory; bad HF directories give one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_train import argv, run_cli, train

REPO = Path(__file__).resolve().parent.parent
PADDED_UNTIED = ["model.vocab_size=300", "model.tie_embeddings=false"]  # 300 pads to 384 / 512: padding on import
UNTIED = ["model.tie_embeddings=false"]  # training runs keep the test tokenizer's 512 ids


def _random_llama(directory: Path, overrides: list[str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from cplm_dist.hf_llama import hf_config

    cfg = load_config("tiny", ["copy.enabled=false", *overrides])
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf_config(cfg.model).items() if k != "architectures"}))
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)


def _hf_logprobs(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(4))


def _import_worker(tp, directory, overrides):
    from cplm_dist.hf_llama import initialise_from_hf
    from cplm_dist.model import build_model
    from cplm_dist.parallel import init_distributed

    dims = init_distributed(tp)
    cfg = load_config("tiny", [*overrides, f"parallel.tp={tp}"])
    model = build_model(cfg)
    copy_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("copy_head.")}
    initialise_from_hf(model, directory, dims.tp_rank, dims.tp_size)
    ids = _ids(cfg.model.vocab_size)
    out = model(ids)
    return {"logprobs": model.eval().next_token_logprobs(ids), "lm_nll": out.lm_nll.detach(),
            "copy_kept": all(torch.equal(p, copy_before[n]) for n, p in model.named_parameters() if n in copy_before)}


@pytest.mark.parametrize("overrides", [[], PADDED_UNTIED], ids=["tied", "padded-untied"])
def test_a_random_transformers_llama_imports_with_its_own_logits(tmp_path, overrides):
    _random_llama(tmp_path / "llama", overrides)
    ids = _ids(load_config("tiny", overrides).model.vocab_size)
    want = _hf_logprobs(tmp_path / "llama", ids)
    for tp in (1, 2):
        got = run_ranks(_import_worker, tp, args=(tp, tmp_path / "llama", ["copy.enabled=false", *overrides]))
        for rank in got:
            torch.testing.assert_close(rank["logprobs"], want, rtol=1e-5, atol=1e-5, msg=f"tp={tp}")
    # copy on: the backbone imports, the copy head keeps its fresh weights, the LM head's own loss is Llama's
    got = run_ranks(_import_worker, 1, args=(1, tmp_path / "llama", overrides))[0]
    nll = -want[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got["lm_nll"][:, :-1], nll, rtol=1e-5, atol=1e-5)
    assert got["copy_kept"]


# --- a copy-off run at tp = 2 started from a HF Llama: init_from, any-tp loading, export ---------------


@pytest.fixture(scope="module")
def from_llama(small_data, tmp_path_factory):
    """A fresh tp = 2 run with model.init_from and a negligible lr: its checkpoint holds the Llama."""
    root = tmp_path_factory.mktemp("hf")
    _random_llama(root / "llama", UNTIED)
    out = root / "tp2"
    assert train(2, argv(small_data, out, "train.train_steps=1", "train.save_interval=1", "parallel.tp=2",
                         "train.zero_stage=1", "copy.enabled=false", "optim.lr=1e-30", "optim.min_lr=0",
                         "optim.warmup_steps=0", "optim.weight_decay=0", f"model.init_from={root / 'llama'}",
                         *UNTIED)) == [0, 0]
    return out, root / "llama"


def _loaded_full(checkpoint):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.model.sharding import full_state_dict
    from cplm_dist.parallel import init_distributed

    init_distributed(1)
    model, cfg, _ = load_model(checkpoint)
    return full_state_dict([model.state_dict()], model), cfg


def test_init_from_starts_a_run_from_a_hf_directory(from_llama):
    from safetensors.torch import load_file

    from cplm_dist.hf_llama import to_hf

    run, llama = from_llama
    full, cfg = run_ranks(_loaded_full, 1, args=(run,))[0]
    saved = to_hf(full, cfg.model)
    source = load_file(str(llama / "model.safetensors"))
    assert sorted(saved) == sorted(source)
    for name, tensor in source.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)


def _load_worker(tp, checkpoint):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.parallel import evaluation_tp, init_distributed

    init_distributed(evaluation_tp())
    model, cfg, _ = load_model(checkpoint)
    return model.next_token_logprobs(_ids(cfg.model.vocab_size))


def test_a_checkpoint_loads_at_any_tp_and_exports_to_a_stock_llama(from_llama, tmp_path):
    run, llama = from_llama
    at = {tp: run_ranks(_load_worker, tp, args=(tp, run))[0] for tp in (1, 2, 4)}
    for tp in (2, 4):
        torch.testing.assert_close(at[tp], at[1], rtol=1e-5, atol=1e-5, msg=f"loaded at tp={tp} vs tp=1")
    torch.testing.assert_close(at[1], _hf_logprobs(llama, _ids(512)), rtol=1e-5, atol=1e-5)  # lr ~ 0: still the Llama
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    torch.testing.assert_close(_hf_logprobs(out, _ids(512)), at[1], rtol=1e-5, atol=1e-5)
    # an existing --out is kept
    proc = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"error: --out {out} exists")


def test_bad_hf_directories_give_one_line(small_data, tmp_path):
    _random_llama(tmp_path / "llama", [])
    (tmp_path / "empty").mkdir()
    fresh = tmp_path / "fresh"
    cases = [
        ([f"model.init_from={tmp_path / 'empty'}"],
         f"error: model.init_from={tmp_path / 'empty'}: no config.json there; point it at a directory written by save_pretrained"),
        ([f"model.init_from={tmp_path / 'llama'}", "model.num_layers=3"],
         f"error: model.init_from={tmp_path / 'llama'}: num_hidden_layers=2 but model.num_layers=3: set model.num_layers=2 "
         "(the shapes must match the checkpoint)"),
    ]
    for extra, expected in cases:
        proc = run_cli(argv(small_data, fresh, *extra))
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == expected
        assert not fresh.exists()
