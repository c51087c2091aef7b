"""Checkpoints beyond one layout and beyond this project: a checkpoint loads at any tp; a random
transformers Llama or Qwen3 imports at tp 1 and 2 with its own logits; an export is a stock
LlamaForCausalLM / Qwen3ForCausalLM (copy off) or our remote-code CPLMForCausalLM /
CPLMQwen3ForCausalLM (copy on) with our log-probs and our greedy tokens, and a
generation_config.json with the tokenizer's ids; `model.init_from` starts a training run from a HF
directory; bad HF directories give one line. GPT-2's side: tests/test_hf_gpt2.py (it shares the
helpers here)."""

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
QWEN3 = ["model.arch=qwen3", "model.head_dim=24"]  # q is 8 x 24 = 192 wide for a 128-wide model: head_dim its own


# the tests' SentencePiece (conftest) as an export carries it: bos and eos its end-of-document id (tokenizer_files.py)
TEST_TOKENIZER_IDS = {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 3}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]


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


def _random_hf(directory: Path, overrides: list[str], **hf) -> None:
    """A random transformers model of the stock class of the backbone `overrides` choose (Llama by
    default), of the tiny shapes (`hf`: config keys to change), saved with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cplm_dist.config.backbones import backbone

    cfg = load_config("tiny", ["copy.enabled=false", *overrides])
    adapter = backbone(cfg.model).hf
    fields = {k: v for k, v in adapter.stock_config(cfg.model).items() if k != "torch_dtype"}
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(adapter.model_type, **{**fields, **hf}))
    assert type(model).__name__ == adapter.architecture
    with torch.no_grad():  # random norms too (q/k norms included), so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)


def _hf_model(directory: Path, remote: bool = False):
    """The directory loaded as a user would: its remote class (trust_remote_code), else the stock
    class its config.json names, without remote code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=remote, dtype=torch.float32).eval()
    assert [type(model).__name__] == json.loads((directory / "config.json").read_text())["architectures"]
    return model


def _hf_logprobs(directory: Path, ids: torch.Tensor, remote: bool = False) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_hf_model(directory, remote)(input_ids=ids).logits.float(), dim=-1)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(4))


def _import_worker(tp, cases):
    """For each (directory, overrides): the model built at this tp, initialised from the directory
    as training does (model.init_from: the map its backbone's record names)."""
    from cplm_dist.interop.init_from import initialise_from
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model

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


def test_a_random_transformers_llama_or_qwen3_imports_with_its_own_logits(tmp_path):
    """Llama tied, padded + untied and linear RoPE, Qwen3 (its own head_dim, q/k norms) tied and
    padded + untied with linear RoPE, at tp 1 and 2, copy off; and (tp 1) copy on: the backbone
    imports, the copy head keeps its fresh weights, the LM head's own loss is Llama's."""
    linear = ["model.rope_scaling={type: linear, factor: 2}"]
    variants = {"tied": [], "padded-untied": PADDED_UNTIED, "linear": linear, "qwen3-tied": QWEN3,
                "qwen3-padded-untied-linear": [*QWEN3, *PADDED_UNTIED, *linear, "model.rope_theta=1000000.0"]}
    want = {}
    for name, overrides in variants.items():
        _random_hf(tmp_path / name, overrides)
        want[name] = _hf_logprobs(tmp_path / name, _ids(load_config("tiny", overrides).model.vocab_size))
    cases = [(tmp_path / name, ["copy.enabled=false", *overrides]) for name, overrides in variants.items()]
    assert_imports(cases, want, copy_on=(tmp_path / "tied", []))


def assert_imports(cases: list, want: dict, copy_on: tuple) -> None:
    """Each (directory, overrides) of `cases`, imported at tp 1 and 2, gives the log-probs `want`
    has under the directory's name; `copy_on` (the "tied" directory in a copy-on run, tp 1) keeps
    its fresh copy head and its LM head's own loss is the source model's."""
    for tp in (1, 2):
        for rank in run_ranks(_import_worker, tp, args=(tp, cases + [copy_on] if tp == 1 else cases)):
            for (directory, _), res in zip(cases, rank):
                name = directory.name
                torch.testing.assert_close(res["logprobs"], want[name], rtol=1e-5, atol=1e-5, msg=f"{name}, tp={tp}")
        if tp == 1:
            on, ids = rank[len(cases)], _ids(512)
            nll = -want["tied"][:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            torch.testing.assert_close(on["lm_nll"][:, :-1], nll, rtol=1e-5, atol=1e-5)
            assert on["copy_kept"]


# --- a copy-on run at tp = 2 started from a HF Llama: init_from, any-tp loading, export ----------------


@pytest.fixture(scope="module")
def from_llama(small_data, tmp_path_factory):
    """A fresh tp = 2 copy-on run with model.init_from and a negligible lr: its checkpoint holds the
    Llama's backbone and a fresh copy head."""
    root = tmp_path_factory.mktemp("hf")
    _random_hf(root / "llama", UNTIED)
    out = root / "tp2"
    assert train(2, argv(small_data, out, "train.train_steps=1", "train.save_interval=1", "parallel.tp=2",
                         "train.zero_stage=1", "optim.lr=1e-30", "optim.min_lr=0",
                         "optim.warmup_steps=0", "optim.weight_decay=0", f"model.init_from={root / 'llama'}",
                         *UNTIED)) == [0, 0]
    return out, root / "llama"


def _load_error_worker(checkpoint):
    from cplm_dist.checkpoint import CheckpointError, load_model
    from cplm_dist.distributed import evaluation_tp, init_distributed

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

    from cplm_dist.config.backbones import backbone

    llama, m = from_llama[1], loaded[1]["cfg"].model
    saved = {k: v for k, v in backbone(m).hf.to_hf(loaded[1]["full"], m).items() if not k.startswith("copy_head.")}
    source = load_file(str(llama / "model.safetensors"))
    assert sorted(saved) == sorted(source)
    for name, tensor in source.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)


def _load_worker(tp, checkpoint):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.distributed import evaluation_tp, init_distributed
    from cplm_dist.model.parallel.sharding import full_state_dict

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
    from cplm_dist.interop.hf.directory import REMOTE_FILES

    proc = subprocess.run([sys.executable, "tools/export_hf.py", "--checkpoint", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "generation_config.json", "model.safetensors",
                                                            *TOKENIZER_FILES, *REMOTE_FILES])
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
    from cplm_dist.interop.hf.directory import HFImportError, check_hf_dir

    _random_hf(tmp_path / "llama", [])
    (tmp_path / "empty").mkdir()
    m = load_config("tiny").model
    with pytest.raises(HFImportError, match=r"no config\.json there; point it at a directory written by save_pretrained$"):
        check_hf_dir(tmp_path / "empty", m)
    m.rope_theta = 500000.0
    with pytest.raises(HFImportError, match=r"RoPE default with theta 10000\.0, .* set model\.rope_theta=10000\.0"):
        check_hf_dir(tmp_path / "llama", m)
    # scaled RoPE: a linear Llama needs the same model.rope_scaling; a plain one takes any (a context extension)
    _random_hf(tmp_path / "linear", ["model.rope_scaling={type: linear, factor: 2}"])
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


def _variant(root: Path, name: str, source: Path, **changes) -> Path:
    """A copy of `source` whose config.json has these keys changed (None: left out)."""
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (root / name).mkdir()
    (root / name / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    (root / name / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return root / name


def test_what_transformers_qwen3_and_llama_compute_differently_is_one_line(tmp_path):
    """Sliding-window layers (transformers' own Qwen3Config deciding which, or layer_types), attention
    biases, another head_dim or norm epsilon, the wrong model.arch: each the line naming the fix."""
    from cplm_dist.interop.hf.directory import HFImportError, check_hf_dir

    _random_hf(tmp_path / "qwen3", QWEN3)
    _random_hf(tmp_path / "window", QWEN3, use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    _random_hf(tmp_path / "llama", [])
    ok, llama = load_config("tiny", QWEN3).model, load_config("tiny").model
    check_hf_dir(tmp_path / "qwen3", ok)
    no_window = "the CPLM qwen3 attends to every earlier position on every layer: not importable (a Qwen3 with "
    cases = [  # (directory, our model config, the line)
        (tmp_path / "window", ok, f"/window: sliding-window attention on layers [1] (use_sliding_window=true, layer_types); "
                                  f"{no_window}use_sliding_window=false is)"),
        (_variant(tmp_path, "types", tmp_path / "qwen3", layer_types=["sliding_attention", "full_attention"]), ok,
         f"/types: sliding-window attention on layers [0] (use_sliding_window=false, layer_types); {no_window}"
         "use_sliding_window=false is)"),
        (_variant(tmp_path, "bias", tmp_path / "qwen3", attention_bias=True), ok,
         "/bias: attention_bias=true; the CPLM backbone has no biases"),
        (_variant(tmp_path, "head-dim", tmp_path / "qwen3", head_dim=None), ok,  # left out: Qwen3Config's 128
         "/head-dim: head_dim=128 but model.head_dim=24: set model.head_dim=128 (the shapes must match the checkpoint)"),
        (_variant(tmp_path, "eps", tmp_path / "qwen3", rms_norm_eps=1e-6), ok,
         "/eps: rms_norm_eps=1e-06 but model.norm_eps=1e-05: set model.norm_eps=1e-06"),
        (_variant(tmp_path, "yarn", tmp_path / "qwen3", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                         "factor": 4.0}), ok,
         "/yarn: RoPE yarn does not import (plain and linear do): start from a Qwen3 with rope_type default or linear"),
        (tmp_path / "qwen3", llama, "/qwen3: its model_type is qwen3, which model.arch=llama does not read: set model.arch=qwen3"),
        (tmp_path / "llama", ok, "/llama: its model_type is llama, which model.arch=qwen3 does not read: set model.arch=llama"),
        (_variant(tmp_path, "llama-eps", tmp_path / "llama", rms_norm_eps=1e-6), llama,
         "/llama-eps: rms_norm_eps=1e-06 but model.norm_eps=1e-05: set model.norm_eps=1e-06"),
        (_variant(tmp_path, "llama-head-dim", tmp_path / "llama", head_dim=32), llama,
         "/llama-head-dim: head_dim=32 but model.head_dim=16: set model.head_dim=32 (the shapes must match the checkpoint)"),
    ]
    for directory, m, line in cases:
        with pytest.raises(HFImportError) as e:
            check_hf_dir(directory, m)
        assert str(e.value) == f"model.init_from={tmp_path}{line}", directory.name


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
    # Qwen3: its own head_dim, its q/k norms (random, as every norm here), copy off and on
    "qwen3-off-untied": [*QWEN3, "copy.enabled=false", "model.tie_embeddings=false"],
    "qwen3-sentinel-self-2heads-rope-ntk": [*QWEN3, "copy.mix=sentinel", "copy.paste=self", "copy.num_heads=2",
                                            "copy.rope=true", "model.rope_scaling={type: ntk, factor: 3}"],
    "qwen3-gate-next-linear": [*QWEN3, "model.rope_scaling={type: linear, factor: 2}"],
}
CLASSES = {"llama": ("LlamaForCausalLM", "CPLMForCausalLM"), "qwen3": ("Qwen3ForCausalLM", "CPLMQwen3ForCausalLM")}


def _export_worker(directory):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import full_state_dict

    init_distributed(1)
    out = {}
    for name, overrides in EXPORT_VARIANTS.items():
        cfg = load_config("tiny", [*overrides, "model.vocab_size=300", "model.rope_theta=5000"])
        model = build_model(cfg).eval()
        with torch.no_grad():  # random norms, so a swapped one (q's for k's) would show
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        (Path(directory) / name).mkdir()
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(directory) / name, torch.float32)
        span = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(6))
        ids = torch.cat([span, span], dim=1)  # repeats, so the copy head has matches
        out[name] = {"ids": ids, "logprobs": model.next_token_logprobs(ids), "greedy": generate(model, ids[:, :9], 5).tokens}
    return out


def test_every_mix_and_paste_exports_with_our_log_probs_and_greedy_tokens(tmp_path):
    ours = run_ranks(_export_worker, 1, args=(str(tmp_path),))[0]
    for name, r in ours.items():
        config = (tmp_path / name / "config.json").read_text()
        copy_off = "copy.enabled=false" in EXPORT_VARIANTS[name]
        stock, remote = CLASSES[load_config("tiny", EXPORT_VARIANTS[name]).model.arch]
        assert json.loads(config)["architectures"] == [stock if copy_off else remote], name
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
    """cplm_dist/interop/hf/remote stays standalone (transformers loads it from the export directory,
    without cplm_dist), so it spells the mixes again: its copy head's own parameters, its head
    averaging and its log-weights are pinned here to each record of cplm_dist.model.mixes."""
    pytest.importorskip("transformers")
    from cplm_dist.interop.hf.remote.configuration_cplm import CPLMConfig
    from cplm_dist.interop.hf.remote.modeling_cplm import CPLMForCausalLM
    from cplm_dist.model.mixes import MIXES

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
