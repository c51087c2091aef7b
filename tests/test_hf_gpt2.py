"""GPT-2 beyond this project: a random transformers GPT2LMHeadModel imports at tp 1 and 2 with its
own logits; a gpt2 export is a stock GPT2LMHeadModel (copy off; grouped-query K/V heads repeated,
tied or untied) or our remote-code CPLMGPT2ForCausalLM (copy on) with our log-probs and our greedy
tokens; a gpt2 run from a HF GPT-2 exports the same GPT-2; bad GPT-2 directories give one line.
The Llama side, and the helpers both share, are tests/test_hf.py's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_hf import (PADDED_UNTIED, REPO, TEST_TOKENIZER_IDS, TOKENIZER_FILES, UNTIED, _assert_generation_config,
                           _hf_model, _ids, _random_hf, _variant, assert_imports)
from tests.test_train import argv, run_cli, train

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

    from cplm_dist.config.backbones import backbone

    cfg = load_config("tiny", [*GPT2, "copy.enabled=false", *overrides])
    fields = {k: v for k, v in backbone(cfg.model).hf.stock_config(cfg.model).items() if k != "torch_dtype"}
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
    assert_imports(cases, want, copy_on=(tmp_path / "tied", [*GPT2, *MHA]))


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
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import full_state_dict

    init_distributed(1)
    out = {}
    for name, overrides in GPT2_EXPORTS.items():
        cfg = load_config("tiny", [*GPT2, *overrides, "model.vocab_size=300", "model.max_seq_len=32",
                                        "data.seq_length=32"])
        model = build_model(cfg).eval()
        _randomise(model)
        (Path(directory) / name).mkdir()
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(directory) / name, torch.float32,
                     tokens=TEST_TOKENIZER_IDS)
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
    """Copy on: CPLMGPT2ForCausalLM (cplm_dist/interop/hf/remote/modeling_cplm_gpt2.py, trust_remote_code)
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
        assert (root / name / "modeling_cplm_gpt2.py").is_file(), "cplm_dist/interop/hf/remote/modeling_cplm_gpt2.py is missing"
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
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "generation_config.json", "model.safetensors",
                                                            *TOKENIZER_FILES])
    saved, want = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    assert sorted(saved) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)
    hf = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_hf_logprobs_gpt2(out, _ids(512)), _hf_logprobs_gpt2(source, _ids(512)), rtol=1e-5, atol=1e-5)
    _assert_generation_config(out, hf, TEST_TOKENIZER_IDS)


def test_bad_gpt2_directories_give_one_line(small_data, tmp_path):
    from cplm_dist.interop.init_from import init_source
    from cplm_dist.errors import UsageError
    from cplm_dist.interop.hf.directory import HFImportError, check_hf_dir, read_hf
    from cplm_dist.config.backbones import backbone

    _random_gpt2(tmp_path / "gpt2", MHA)
    _random_hf(tmp_path / "llama", [])
    ok = load_config("tiny", [*GPT2, *MHA]).model
    check_hf_dir(tmp_path / "gpt2", ok)
    llama = load_config("tiny").model
    where = f"model.init_from={tmp_path}"
    cases = [  # (directory, our model config, the line)
        (tmp_path / "gpt2", llama, "/gpt2: its model_type is gpt2, which model.arch=llama does not read: set model.arch=gpt2"),
        (tmp_path / "llama", ok, "/llama: its model_type is llama, which model.arch=gpt2 does not read: set model.arch=llama"),
        (_variant(tmp_path, "mistral", tmp_path / "gpt2", model_type="mistral"), ok,
         "/mistral: model_type='mistral': only model_type llama, mixtral, gpt2, qwen3 or qwen3_moe checkpoints import"),
        (tmp_path / "gpt2", load_config("tiny", GPT2).model,
         "/gpt2: GPT-2 has a K/V head per query head (n_head=8), this run has model.num_kv_heads=4: set model.num_kv_heads=8"),
        (_variant(tmp_path, "gelu", tmp_path / "gpt2", activation_function="gelu"), ok,
         "/gelu: activation_function='gelu'; the CPLM gpt2 MLP is GELU's tanh approximation (gelu_new or gelu_pytorch_tanh): "
         "not importable"),
        (_variant(tmp_path, "positions", tmp_path / "gpt2", n_positions=None), ok,  # left out: GPT2Config's 1024
         "/positions: n_positions=1024 but model.max_seq_len=512: set model.max_seq_len=1024 (a learned position table "
         "cannot stretch or shrink)"),
        (_variant(tmp_path, "inner", tmp_path / "gpt2", n_inner=None), ok,  # None: 4 D
         "/inner: n_inner=512 but model.ffn_hidden_size=256: set model.ffn_hidden_size=512 (the shapes must match the checkpoint)"),
        (_variant(tmp_path, "eps", tmp_path / "gpt2", layer_norm_epsilon=1e-6), ok,
         "/eps: layer_norm_epsilon=1e-06 but model.norm_eps=1e-05: set model.norm_eps=1e-06"),
        (_variant(tmp_path, "by-layer", tmp_path / "gpt2", scale_attn_by_inverse_layer_idx=True), ok,
         "/by-layer: scale_attn_by_inverse_layer_idx=true; the CPLM gpt2 attention is plain causal self-attention at "
         "1/sqrt(head_dim): not importable"),
        (_variant(tmp_path, "upcast", tmp_path / "gpt2", reorder_and_upcast_attn=True), ok,
         "/upcast: reorder_and_upcast_attn=true; the CPLM gpt2 attention is plain causal self-attention at "
         "1/sqrt(head_dim): not importable"),
        (_variant(tmp_path, "untied", tmp_path / "gpt2", tie_word_embeddings=False), ok,
         "/untied: tie_word_embeddings=false (its own LM head) but model.tie_embeddings=true: set model.tie_embeddings=false"),
    ]
    for directory, m, line in cases:
        with pytest.raises(HFImportError) as e:
            check_hf_dir(directory, m)
        assert str(e.value) == where + line, directory.name
    with pytest.raises(HFImportError, match=r"its weights do not fit a GPT2LMHeadModel of these shapes"):
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_bytes((tmp_path / "gpt2" / "config.json").read_bytes())
        (tmp_path / "llama" / "model.safetensors").rename(tmp_path / "broken" / "model.safetensors")
        read_hf(tmp_path / "broken", ok)
    assert init_source(load_config("tiny", [*GPT2, *MHA, f"model.init_from={tmp_path / 'gpt2'}"])).kind == "hf"
    wide = load_config("tiny", [*GPT2, "model.head_dim=24"]).model  # trains, but GPT-2's heads are n_embd / n_head
    with pytest.raises(UsageError, match=r"^model\.head_dim=24: GPT2LMHeadModel's heads are n_embd / n_head = 16 wide, "
                                         r"so this gpt2 model has no transformers export$"):
        backbone(wide).hf.to_hf({}, wide)  # before any weight is read (tools/export_hf.py: one line, nothing written)
    fresh = tmp_path / "fresh"  # through cplm-train: one line, exit 2, nothing written
    proc = run_cli(argv(small_data, fresh, f"model.init_from={tmp_path / 'gpt2'}"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"error: model.init_from={tmp_path / 'gpt2'}: its model_type is gpt2, "
                                                    "which model.arch=llama does not read: set model.arch=gpt2")
    assert not fresh.exists()
