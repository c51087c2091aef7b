"""Checkpoints beyond one layout and beyond this project: a checkpoint loads at any tp; a random
transformers Llama or GPT-2 imports at tp 1 and 2 with its own logits; an export is a stock
LlamaForCausalLM / GPT2LMHeadModel (copy off) or our remote-code CPLMForCausalLM /
CPLMGPT2ForCausalLM (copy on) with our log-probs and our greedy tokens, and a
generation_config.json with the tokenizer's ids; `model.init_from` starts a training run from a HF
directory; bad HF directories give one line."""

import json
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


TEST_TOKENIZER_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # the tests' SentencePiece (conftest)


def _assert_generation_config(directory: Path, hf, ids: dict) -> None:
    """generation_config.json holds the tokenizer's ids (`ids`: those it has) and use_cache;
    transformers reads it, the loaded model's generation_config is it, config.json agrees."""
    from transformers import GenerationConfig

    saved, config = GenerationConfig.from_pretrained(directory), json.loads((directory / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(saved, key) == getattr(hf.generation_config, key) == ids.get(key), (directory.name, key)
        if key in ids:
            assert config[key] == ids[key], (directory.name, key)
    assert saved.use_cache is True and hf.generation_config.use_cache is True


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


def _hf_model(directory: Path, remote: bool = False):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if remote:
        return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    return LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _hf_logprobs(directory: Path, ids: torch.Tensor, remote: bool = False) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_hf_model(directory, remote)(input_ids=ids).logits.float(), dim=-1)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(4))


def _import_worker(tp, cases):
    """For each (directory, overrides): the model built at this tp, initialised from the directory
    as training does (model.init_from: the map its backbone's record names)."""
    from cplm_dist.checkpoint import initialise_from
    from cplm_dist.model import build_model
    from cplm_dist.parallel import init_distributed

    dims = init_distributed(tp)
    out = []
    for directory, overrides in cases:
        cfg = load_config("tiny", [*overrides, f"parallel.tp={tp}", f"model.init_from={directory}"])
        model = build_model(cfg)
        copy_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("copy_head.")}
        assert initialise_from(model, cfg, dims.tp_rank, dims.tp_size).kind == "hf"
        ids = _ids(cfg.model.vocab_size)
        nll = model(ids).lm_nll.detach()
        out.append({"logprobs": model.eval().next_token_logprobs(ids), "lm_nll": nll,
                    "copy_kept": all(torch.equal(p, copy_before[n]) for n, p in model.named_parameters() if n in copy_before)})
    return out


def test_a_random_transformers_llama_imports_with_its_own_logits(tmp_path):
    """Tied and padded + untied, at tp 1 and 2, copy off; and (tp 1) copy on: the backbone imports,
    the copy head keeps its fresh weights, the LM head's own loss is Llama's."""
    variants = {"tied": [], "padded-untied": PADDED_UNTIED, "linear": ["model.rope_scaling={type: linear, factor: 2}"]}
    want = {}
    for name, overrides in variants.items():
        _random_llama(tmp_path / name, overrides)
        want[name] = _hf_logprobs(tmp_path / name, _ids(load_config("tiny", overrides).model.vocab_size))
    cases = [(tmp_path / name, ["copy.enabled=false", *overrides]) for name, overrides in variants.items()]
    copy_on = (tmp_path / "tied", [])
    for tp in (1, 2):
        for rank in run_ranks(_import_worker, tp, args=(tp, cases + [copy_on] if tp == 1 else cases)):
            for name, res in zip(variants, rank):
                torch.testing.assert_close(res["logprobs"], want[name], rtol=1e-5, atol=1e-5, msg=f"{name}, tp={tp}")
        if tp == 1:
            on, ids = rank[len(variants)], _ids(512)
            nll = -want["tied"][:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            torch.testing.assert_close(on["lm_nll"][:, :-1], nll, rtol=1e-5, atol=1e-5)
            assert on["copy_kept"]


# --- a copy-on run at tp = 2 started from a HF Llama: init_from, any-tp loading, export ----------------


@pytest.fixture(scope="module")
def from_llama(small_data, tmp_path_factory):
    """A fresh tp = 2 copy-on run with model.init_from and a negligible lr: its checkpoint holds the
    Llama's backbone and a fresh copy head."""
    root = tmp_path_factory.mktemp("hf")
    _random_llama(root / "llama", UNTIED)
    out = root / "tp2"
    assert train(2, argv(small_data, out, "train.train_steps=1", "train.save_interval=1", "parallel.tp=2",
                         "train.zero_stage=1", "optim.lr=1e-30", "optim.min_lr=0",
                         "optim.warmup_steps=0", "optim.weight_decay=0", f"model.init_from={root / 'llama'}",
                         *UNTIED)) == [0, 0]
    return out, root / "llama"


def _load_error_worker(checkpoint):
    from cplm_dist.checkpoint import CheckpointError, load_model
    from cplm_dist.parallel import evaluation_tp, init_distributed

    init_distributed(evaluation_tp())
    with pytest.raises(CheckpointError) as e:
        load_model(checkpoint)
    return str(e.value)


def test_a_tp_that_does_not_divide_the_heads_is_one_line(from_llama):
    for message in run_ranks(_load_error_worker, 3, args=(from_llama[0],)):
        assert message == (f"{from_llama[0]} (saved at tp=2) cannot be loaded with 3 ranks: model.num_heads=8 is not "
                           "divisible by parallel.tp=3 (valid tp for this model: [1, 2, 4])")


def test_init_from_starts_a_run_from_a_hf_directory(from_llama, loaded):
    from safetensors.torch import load_file

    from cplm_dist.hf_llama import to_hf

    llama = from_llama[1]
    saved = {k: v for k, v in to_hf(loaded[1]["full"], loaded[1]["cfg"].model).items() if not k.startswith("copy_head.")}
    source = load_file(str(llama / "model.safetensors"))
    assert sorted(saved) == sorted(source)
    for name, tensor in source.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)


def _load_worker(tp, checkpoint):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.model.sharding import full_state_dict
    from cplm_dist.parallel import evaluation_tp, init_distributed

    init_distributed(evaluation_tp())
    model, cfg, _ = load_model(checkpoint)
    full = full_state_dict([model.state_dict()], model) if tp == 1 else None
    return {"logprobs": model.next_token_logprobs(_ids(cfg.model.vocab_size)), "full": full, "cfg": cfg}


@pytest.fixture(scope="module")
def loaded(from_llama):
    return {tp: run_ranks(_load_worker, tp, args=(tp, from_llama[0]))[0] for tp in (1, 2, 4)}


def test_a_checkpoint_loads_at_any_tp_and_exports(from_llama, loaded, tmp_path):
    run = from_llama[0]
    at = {tp: r["logprobs"] for tp, r in loaded.items()}
    for tp in (2, 4):
        torch.testing.assert_close(at[tp], at[1], rtol=1e-5, atol=1e-5, msg=f"loaded at tp={tp} vs tp=1")
    out = tmp_path / "exported"
    from cplm_dist.hf_llama import REMOTE_FILES

    proc = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "generation_config.json", "model.safetensors",
                                                            "tokenizer.model", *REMOTE_FILES])
    assert "modeling_cplm.py" in REMOTE_FILES
    hf = _hf_model(out, remote=True)
    with torch.no_grad():
        torch.testing.assert_close(torch.log_softmax(hf(input_ids=_ids(512)).logits, -1), at[1], rtol=1e-5, atol=1e-5)
    _assert_generation_config(out, hf, TEST_TOKENIZER_IDS)
    # an existing --out is kept
    proc = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"error: --out {out} exists")


def test_bad_hf_directories_give_one_line(small_data, tmp_path):
    from cplm_dist import hf_llama
    from cplm_dist.hf_llama import HFImportError

    def check_hf_dir(directory, m):
        return hf_llama.check_hf_dir(directory, m, hf_llama)

    _random_llama(tmp_path / "llama", [])
    (tmp_path / "empty").mkdir()
    m = load_config("tiny").model
    with pytest.raises(HFImportError, match=r"no config\.json there; point it at a directory written by save_pretrained$"):
        check_hf_dir(tmp_path / "empty", m)
    m.rope_theta = 500000.0
    with pytest.raises(HFImportError, match=r"RoPE default with theta 10000\.0, .* set model\.rope_theta=10000\.0"):
        check_hf_dir(tmp_path / "llama", m)
    # scaled RoPE: a linear Llama needs the same model.rope_scaling; a plain one takes any (a context extension)
    _random_llama(tmp_path / "linear", ["model.rope_scaling={type: linear, factor: 2}"])
    plain = load_config("tiny").model
    with pytest.raises(HFImportError, match=r"RoPE linear with factor 2\.0, the config has model\.rope_scaling=None: "
                                            r"set model\.rope_scaling\.type=linear model\.rope_scaling\.factor=2\.0$"):
        check_hf_dir(tmp_path / "linear", plain)
    check_hf_dir(tmp_path / "llama", load_config("tiny", ["model.rope_scaling={type: ntk, factor: 4}"]).model)
    config = json.loads((tmp_path / "linear" / "config.json").read_text())
    (tmp_path / "yarn").mkdir()
    (tmp_path / "yarn" / "model.safetensors").write_bytes((tmp_path / "linear" / "model.safetensors").read_bytes())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "yarn"}
    config.pop("rope_scaling", None)
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"RoPE yarn does not import \(plain and linear do\)"):
        check_hf_dir(tmp_path / "yarn", plain)
    fresh = tmp_path / "fresh"  # through cplm-train: one line, exit 2, nothing written
    proc = run_cli(argv(small_data, fresh, f"model.init_from={tmp_path / 'llama'}", "model.num_layers=3"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: model.init_from={tmp_path / 'llama'}: num_hidden_layers=2 but model.num_layers=3: set model.num_layers=2 "
        "(the shapes must match the checkpoint)")
    assert not fresh.exists()


EXPORT_VARIANTS = {
    "off": ["copy.enabled=false"],
    "gate-next": [],
    "gate-self-2heads-rope": ["copy.paste=self", "copy.num_heads=2", "copy.rope=true", "copy.gate_bias_init=-1"],
    "joint-next-2heads": ["copy.mix=joint", "copy.num_heads=2"],
    "joint-self": ["copy.mix=joint", "copy.paste=self"],
    "sentinel-next-rope": ["copy.mix=sentinel", "copy.rope=true"],
    "sentinel-self-2heads": ["copy.mix=sentinel", "copy.paste=self", "copy.num_heads=2"],
    # context extension: scaled RoPE (docs/training.md), on the backbone and on the copy head's own RoPE
    "off-linear": ["copy.enabled=false", "model.rope_scaling={type: linear, factor: 4}"],
    "off-ntk": ["copy.enabled=false", "model.rope_scaling={type: ntk, factor: 4}"],
    "gate-next-rope-linear": ["copy.rope=true", "model.rope_scaling={type: linear, factor: 2.5}"],
    "joint-self-rope-ntk": ["copy.mix=joint", "copy.paste=self", "copy.rope=true", "model.rope_scaling={type: ntk, factor: 3}"],
}


def _export_worker(directory):
    from cplm_dist.checkpoint.init_from import hf_map
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.hf_llama import write_hf_dir
    from cplm_dist.model import build_model
    from cplm_dist.model.sharding import full_state_dict
    from cplm_dist.parallel import init_distributed

    init_distributed(1)
    out = {}
    for name, overrides in EXPORT_VARIANTS.items():
        cfg = load_config("tiny", [*overrides, "model.vocab_size=300", "model.rope_theta=5000"])
        model = build_model(cfg).eval()
        (Path(directory) / name).mkdir()
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(directory) / name, torch.float32,
                     hf_map(cfg.model))
        span = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(6))
        ids = torch.cat([span, span], dim=1)  # repeats, so the copy head has matches
        out[name] = {"ids": ids, "logprobs": model.next_token_logprobs(ids), "greedy": generate(model, ids[:, :9], 5).tokens}
    return out


def test_every_mix_and_paste_exports_with_our_log_probs_and_greedy_tokens(tmp_path):
    ours = run_ranks(_export_worker, 1, args=(str(tmp_path),))[0]
    for name, r in ours.items():
        config = (tmp_path / name / "config.json").read_text()
        copy_off = name.startswith("off")
        assert ('"CPLMForCausalLM"' in config) == (not copy_off)
        rope = json.loads(config)
        if name.endswith("-linear"):  # transformers' linear type, both spellings; ntk: plain RoPE at the larger theta
            assert rope["rope_scaling"]["rope_type"] == rope["rope_parameters"]["rope_type"] == "linear"
        else:
            assert "rope_scaling" not in rope and rope["rope_parameters"]["rope_type"] == "default"
            assert (rope["rope_theta"] > 5000) == name.endswith("-ntk")
        hf = _hf_model(tmp_path / name, remote=not copy_off)
        with torch.no_grad():
            got = torch.log_softmax(hf(input_ids=r["ids"]).logits.float(), dim=-1)
        torch.testing.assert_close(got, r["logprobs"], rtol=1e-5, atol=1e-5, msg=name)
        _assert_generation_config(tmp_path / name, hf, {})  # no tokenizer: a KV cache and no token ids
        hf.generation_config.eos_token_id = None  # LlamaConfig's default 2: ours runs the full 5 tokens
        tokens = hf.generate(r["ids"][:, :9], max_new_tokens=5, do_sample=False, pad_token_id=0)[:, 9:]
        assert torch.equal(tokens, r["greedy"]), name


def test_the_exported_remote_code_has_the_mixes_of_the_records():
    """cplm_dist/hf_remote stays standalone (transformers loads it from the export directory,
    without cplm_dist), so it spells the mixes again: its copy head's own parameters, its head
    averaging and its log-weights are pinned here to each record of cplm_dist.mixes."""
    pytest.importorskip("transformers")
    from cplm_dist.hf_remote.configuration_cplm import CPLMConfig
    from cplm_dist.hf_remote.modeling_cplm import CPLMForCausalLM
    from cplm_dist.mixes import MIXES

    g = torch.Generator().manual_seed(0)
    lse, copy_all, gate = (torch.randn(6, generator=g) for _ in range(3))
    copy_all[0] = float("-inf")  # a row without candidates
    ids = torch.randint(0, 64, (1, 8), generator=g)
    for name, mix in MIXES.items():
        cfg = CPLMConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, copy_num_heads=2, copy_head_dim=4, copy_mix=name)
        model = CPLMForCausalLM(cfg).eval()
        own = {n: tuple(p.shape) for n, p in model.copy_head.named_parameters() if not n.startswith(("q.", "k."))}
        assert own == {n: shape for n, shape, _ in mix.own_parameters(16, 2, 4)}, name
        got = model._mix_weights(lse, copy_all, gate if mix.gate else None)
        want = mix.log_weights(lse, copy_all, gate if mix.gate else None, torch.isfinite(copy_all))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        with torch.no_grad():
            h = model.model(input_ids=ids).last_hidden_state
            terms_all = model._copy_terms(h, ids)[0][:, 1:]  # A_t where candidates exist
        # averaged heads normalise each head's distribution: A_t = 0; pooled ones keep the pool's LSE
        assert bool((terms_all == 0).all()) == mix.average_heads, name



# --- GPT-2: a stock GPT2LMHeadModel both ways, our remote class for copy on ----------------------------

GPT2 = ["model.arch=gpt2"]
MHA = ["model.num_kv_heads=8"]  # GPT-2 has a K/V head per query head: what an import needs


def _randomise(model: torch.nn.Module) -> None:
    """Random norms and biases (they start at 1 and 0), so a swapped or dropped one would show, and
    a larger position table, so greedy tokens depend on where they are (a wrong cache offset shows)."""
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif p.ndim == 1:  # a norm's weight
                p.uniform_(0.5, 1.5)
            elif name in ("position_embedding.weight", "transformer.wpe.weight"):
                p.normal_(0, 0.5)


def _random_gpt2(directory: Path, overrides: list[str], **hf) -> None:
    """A random transformers GPT2LMHeadModel of the tiny shapes (`hf`: config keys to change)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from cplm_dist.hf_gpt2 import hf_config

    cfg = load_config("tiny", [*GPT2, "copy.enabled=false", *overrides])
    fields = {k: v for k, v in hf_config(cfg.model).items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(**{**fields, **hf}))
    _randomise(model)
    model.save_pretrained(directory, safe_serialization=True)


GPT2_IMPORTS = {  # name: (our overrides, the HF config's changes)
    "tied": (MHA, {}),
    "padded-untied": ([*MHA, *PADDED_UNTIED], {}),
    "n_inner-none-pytorch-tanh": ([*MHA, "model.ffn_hidden_size=512"], {"n_inner": None, "activation_function": "gelu_pytorch_tanh"}),
}


def test_a_random_transformers_gpt2_imports_with_its_own_logits(tmp_path):
    """Tied, padded + untied, and n_inner None (4 D) with gelu_pytorch_tanh, at tp 1 and 2 copy off
    through model.init_from; and (tp 1) copy on: the backbone imports, the copy head keeps its fresh
    weights, the LM head's own loss is GPT-2's."""
    want = {}
    for name, (overrides, hf) in GPT2_IMPORTS.items():
        _random_gpt2(tmp_path / name, overrides, **hf)
        want[name] = _hf_logprobs_gpt2(tmp_path / name, _ids(load_config("tiny", [*GPT2, *overrides]).model.vocab_size))
    cases = [(tmp_path / name, [*GPT2, "copy.enabled=false", *overrides]) for name, (overrides, _) in GPT2_IMPORTS.items()]
    copy_on = (tmp_path / "tied", [*GPT2, *MHA])
    for tp in (1, 2):
        for rank in run_ranks(_import_worker, tp, args=(tp, cases + [copy_on] if tp == 1 else cases)):
            for name, res in zip(GPT2_IMPORTS, rank):
                torch.testing.assert_close(res["logprobs"], want[name], rtol=1e-5, atol=1e-5, msg=f"{name}, tp={tp}")
        if tp == 1:
            on, ids = rank[len(GPT2_IMPORTS)], _ids(512)
            nll = -want["tied"][:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            torch.testing.assert_close(on["lm_nll"][:, :-1], nll, rtol=1e-5, atol=1e-5)
            assert on["copy_kept"]


def _hf_logprobs_gpt2(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return torch.log_softmax(GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval()(input_ids=ids).logits, -1)


GPT2_EXPORTS = {
    "off-tied-gqa": ["copy.enabled=false"],  # tiny's 4 K/V heads for 8 query heads: repeated
    "off-untied": ["copy.enabled=false", "model.tie_embeddings=false", *MHA],
    "gate-next": [],
    "joint-self-2heads-untied": ["copy.mix=joint", "copy.paste=self", "copy.num_heads=2", "model.tie_embeddings=false"],
    "sentinel-next-rope": ["copy.mix=sentinel", "copy.rope=true", *MHA],
}


def _gpt2_export_worker(directory):
    """Each GPT2_EXPORTS model (random norms and biases), written as training's export writes it
    (the map of its record; the test tokenizer's ids); our log-probs and greedy tokens."""
    from cplm_dist.checkpoint.init_from import hf_map
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.hf_llama import write_hf_dir
    from cplm_dist.model import build_model
    from cplm_dist.model.sharding import full_state_dict
    from cplm_dist.parallel import init_distributed

    init_distributed(1)
    out = {}
    for name, overrides in GPT2_EXPORTS.items():
        cfg = load_config("tiny", [*GPT2, *overrides, "model.vocab_size=300", "model.max_seq_len=32",
                                        "data.seq_length=32"])
        model = build_model(cfg).eval()
        _randomise(model)
        (Path(directory) / name).mkdir()
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(directory) / name, torch.float32,
                     hf_map(cfg.model), tokens=TEST_TOKENIZER_IDS)
        span = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(6))
        ids = torch.cat([span, span], dim=1)  # repeats, so the copy head has matches
        out[name] = {"ids": ids, "logprobs": model.next_token_logprobs(ids), "greedy": generate(model, ids[:, :9], 5).tokens}
    return out


@pytest.fixture(scope="module")
def gpt2_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2-exports")
    return root, run_ranks(_gpt2_export_worker, 1, args=(str(root),))[0]


def _check_export(directory: Path, hf, r: dict) -> None:
    """The loaded export's log-probs (1e-5), generation config and greedy tokens are ours."""
    with torch.no_grad():
        got = torch.log_softmax(hf(input_ids=r["ids"]).logits.float(), dim=-1)
    torch.testing.assert_close(got, r["logprobs"], rtol=1e-5, atol=1e-5, msg=directory.name)
    _assert_generation_config(directory, hf, TEST_TOKENIZER_IDS)
    hf.generation_config.eos_token_id = None  # ours runs the full 5 tokens
    prompt = r["ids"][:, :9]  # every position real (else transformers masks the pad id's)
    tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)[:, 9:]
    assert torch.equal(tokens, r["greedy"]), directory.name


def test_a_gpt2_exports_as_a_stock_gpt2lmheadmodel_with_our_log_probs_and_greedy_tokens(gpt2_exports):
    """Copy off: GPT2LMHeadModel without remote code, GQA (K/V heads repeated) and untied exactly."""
    from transformers import GPT2LMHeadModel

    root, ours = gpt2_exports
    for name in (n for n in GPT2_EXPORTS if n.startswith("off")):
        config = json.loads((root / name / "config.json").read_text())
        assert config["architectures"] == ["GPT2LMHeadModel"] and "auto_map" not in config
        assert config["n_positions"] == 32 and config["vocab_size"] == 300 and config["n_head"] == 8
        assert not list((root / name).glob("*.py"))
        hf = GPT2LMHeadModel.from_pretrained(root / name, dtype=torch.float32).eval()
        tied = hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
        assert tied == (name == "off-tied-gqa") and config["tie_word_embeddings"] == tied, name
        _check_export(root / name, hf, ours[name])


def test_a_copy_on_gpt2_exports_as_our_remote_class_with_our_log_probs_and_greedy_tokens(gpt2_exports):
    """Copy on: CPLMGPT2ForCausalLM (cplm_dist/hf_remote/modeling_cplm_gpt2.py, trust_remote_code)
    from config.json's auto_map; GPT2LMHeadModel's weight names plus copy_head.*."""
    from safetensors.torch import load_file

    root, ours = gpt2_exports
    for name in (n for n in GPT2_EXPORTS if not n.startswith("off")):
        config = json.loads((root / name / "config.json").read_text())
        assert config["architectures"] == ["CPLMGPT2ForCausalLM"] and config["model_type"] == "cplm_gpt2"
        assert config["auto_map"] == {"AutoConfig": "configuration_cplm.CPLMGPT2Config",
                                      "AutoModelForCausalLM": "modeling_cplm_gpt2.CPLMGPT2ForCausalLM"}
        assert {"copy_num_heads", "copy_head_dim", "copy_paste", "copy_mix", "copy_rope", "copy_rope_theta",
                "copy_rope_scaling"} <= set(config)
        names = set(load_file(str(root / name / "model.safetensors")))
        assert "transformer.h.0.attn.c_attn.weight" in names and any(n.startswith("copy_head.") for n in names)
        assert (root / name / "modeling_cplm_gpt2.py").is_file(), "cplm_dist/hf_remote/modeling_cplm_gpt2.py is missing"
        _check_export(root / name, _hf_model(root / name, remote=True), ours[name])


@pytest.fixture(scope="module")
def from_gpt2(small_data, tmp_path_factory):
    """A copy-off gpt2 run (tp 1, negligible lr) started from a random HF GPT-2, and its export
    through tools/export_hf.py."""
    root = tmp_path_factory.mktemp("hf-gpt2")
    shape = ["model.max_seq_len=64", "data.seq_length=64", *MHA, *UNTIED]
    _random_gpt2(root / "gpt2", shape)
    run, out = root / "run", root / "exported"
    assert train(1, argv(small_data, run, "train.train_steps=1", "train.save_interval=1", "optim.lr=1e-30", "optim.min_lr=0",
                         "optim.warmup_steps=0", "optim.weight_decay=0", f"model.init_from={root / 'gpt2'}",
                         "copy.enabled=false", *GPT2, *shape)) == [0]
    proc = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "gpt2", out


def test_a_gpt2_run_from_a_hf_gpt2_exports_the_same_gpt2(from_gpt2):
    """cplm-train's model.init_from and tools/export_hf.py pick the GPT-2 map from the record: the
    export is the source's weights, names and logits, with the run's tokenizer and its ids."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    source, out = from_gpt2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.model"]
    saved, want = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    assert sorted(saved) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)
    hf = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_hf_logprobs_gpt2(out, _ids(512)), _hf_logprobs_gpt2(source, _ids(512)), rtol=1e-5, atol=1e-5)
    _assert_generation_config(out, hf, TEST_TOKENIZER_IDS)


def _gpt2_variant(root: Path, name: str, source: Path, **changes) -> Path:
    """A copy of `source` whose config.json has these keys changed (None: left out)."""
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (root / name).mkdir()
    (root / name / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    (root / name / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return root / name


def test_bad_gpt2_directories_give_one_line(small_data, tmp_path):
    from cplm_dist.checkpoint import init_source
    from cplm_dist.checkpoint.init_from import hf_map
    from cplm_dist.hf_llama import HFImportError, check_hf_dir

    _random_gpt2(tmp_path / "gpt2", MHA)
    _random_llama(tmp_path / "llama", [])
    ok = load_config("tiny", [*GPT2, *MHA]).model
    check_hf_dir(tmp_path / "gpt2", ok, hf_map(ok))
    llama = load_config("tiny").model
    where = f"model.init_from={tmp_path}"
    cases = [  # (directory, our model config, the line)
        (tmp_path / "gpt2", llama, "/gpt2: its model_type is gpt2, which model.arch=llama does not read: set model.arch=gpt2"),
        (tmp_path / "llama", ok, "/llama: its model_type is llama, which model.arch=gpt2 does not read: set model.arch=llama"),
        (_gpt2_variant(tmp_path, "mistral", tmp_path / "gpt2", model_type="mistral"), ok,
         "/mistral: model_type='mistral': only model_type llama or gpt2 checkpoints import"),
        (tmp_path / "gpt2", load_config("tiny", GPT2).model,
         "/gpt2: GPT-2 has a K/V head per query head (n_head=8), this run has model.num_kv_heads=4: set model.num_kv_heads=8"),
        (_gpt2_variant(tmp_path, "gelu", tmp_path / "gpt2", activation_function="gelu"), ok,
         "/gelu: activation_function='gelu'; the CPLM gpt2 MLP is GELU's tanh approximation (gelu_new or gelu_pytorch_tanh): "
         "not importable"),
        (_gpt2_variant(tmp_path, "positions", tmp_path / "gpt2", n_positions=None), ok,  # left out: GPT2Config's 1024
         "/positions: n_positions=1024 but model.max_seq_len=512: set model.max_seq_len=1024 (a learned position table "
         "cannot stretch or shrink)"),
        (_gpt2_variant(tmp_path, "inner", tmp_path / "gpt2", n_inner=None), ok,  # None: 4 D
         "/inner: n_inner=512 but model.ffn_hidden_size=256: set model.ffn_hidden_size=512 (the shapes must match the checkpoint)"),
        (_gpt2_variant(tmp_path, "eps", tmp_path / "gpt2", layer_norm_epsilon=1e-6), ok,
         "/eps: layer_norm_epsilon=1e-06 but model.norm_eps=1e-05: set model.norm_eps=1e-06"),
        (_gpt2_variant(tmp_path, "by-layer", tmp_path / "gpt2", scale_attn_by_inverse_layer_idx=True), ok,
         "/by-layer: scale_attn_by_inverse_layer_idx=true; the CPLM gpt2 attention is plain causal self-attention at "
         "1/sqrt(head_dim): not importable"),
        (_gpt2_variant(tmp_path, "upcast", tmp_path / "gpt2", reorder_and_upcast_attn=True), ok,
         "/upcast: reorder_and_upcast_attn=true; the CPLM gpt2 attention is plain causal self-attention at "
         "1/sqrt(head_dim): not importable"),
        (_gpt2_variant(tmp_path, "untied", tmp_path / "gpt2", tie_word_embeddings=False), ok,
         "/untied: tie_word_embeddings=false (its own LM head) but model.tie_embeddings=true: set model.tie_embeddings=false"),
    ]
    for directory, m, line in cases:
        with pytest.raises(HFImportError) as e:
            check_hf_dir(directory, m, hf_map(m))
        assert str(e.value) == where + line, directory.name
    with pytest.raises(HFImportError, match=r"its weights do not fit a GPT2LMHeadModel of these shapes"):
        from cplm_dist.hf_llama import read_hf

        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_bytes((tmp_path / "gpt2" / "config.json").read_bytes())
        (tmp_path / "llama" / "model.safetensors").rename(tmp_path / "broken" / "model.safetensors")
        read_hf(tmp_path / "broken", ok, hf_map(ok))
    assert init_source(load_config("tiny", [*GPT2, *MHA, f"model.init_from={tmp_path / 'gpt2'}"])).kind == "hf"
    fresh = tmp_path / "fresh"  # through cplm-train: one line, exit 2, nothing written
    proc = run_cli(argv(small_data, fresh, f"model.init_from={tmp_path / 'gpt2'}"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"error: model.init_from={tmp_path / 'gpt2'}: its model_type is gpt2, "
                                                    "which model.arch=llama does not read: set model.arch=gpt2")
    assert not fresh.exists()
