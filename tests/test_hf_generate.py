"""generate() of the copy-on remote classes (cplm_dist/interop/hf/remote) with and without their KV cache:
the cached forward feeds the backbone only the new tokens (positions counted) and gives the
uncached log-probs for every mix x paste, on Llama and GPT-2 (and a mix each on Qwen3); the cache's own operations (batch
repeat and select, crop) keep the copy head's part in step; an export loaded with
trust_remote_code gives our decoder's greedy tokens and the same sampled tokens and beams either
way; a chunked prefill and a continued cache too; a bf16 cache keeps the ids exact; padding,
foreign and static caches are one line."""

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks

pytest.importorskip("transformers")

MIXES, PASTES = ("gate", "joint", "sentinel", "joint_gate"), ("next", "self")
# what the copy head's RoPE cycles through across the cases: off, plain, linear, ntk
ROPES = ({"copy_rope": False}, {"copy_rope": True, "copy_rope_theta": 500.0},
         {"copy_rope": True, "copy_rope_scaling": {"type": "linear", "factor": 2.0}},
         {"copy_rope": True, "copy_rope_theta": 500.0, "copy_rope_scaling": {"type": "ntk", "factor": 3.0}})
VOCAB = 97


def _tiny(kind: str, mix: str, paste: str, heads: int = 2, rope: dict | None = None, dtype=torch.float32, vocab=VOCAB):
    """A random copy-on model built from its config; the copy head's weights large enough to
    copy (its trained scale, not its 0.02 initialisation)."""
    from cplm_dist.interop.hf.remote.configuration_cplm import CPLMConfig, CPLMGPT2Config, CPLMQwen3Config
    from cplm_dist.interop.hf.remote.modeling_cplm import CPLMForCausalLM
    from cplm_dist.interop.hf.remote.modeling_cplm_gpt2 import CPLMGPT2ForCausalLM
    from cplm_dist.interop.hf.remote.modeling_cplm_qwen3 import CPLMQwen3ForCausalLM

    copy = {"copy_num_heads": heads, "copy_head_dim": 8, "copy_mix": mix, "copy_paste": paste, **(rope or ROPES[1])}
    torch.manual_seed(0)
    if kind == "llama":
        model = CPLMForCausalLM(CPLMConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, **copy))
    elif kind == "qwen3":  # head_dim its own (4 x 12 = 48 for a 32-wide model)
        model = CPLMQwen3ForCausalLM(CPLMQwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, **copy))
    else:
        model = CPLMGPT2ForCausalLM(CPLMGPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=None, eos_token_id=None, pad_token_id=None, **copy))
    with torch.no_grad():
        for p in model.copy_head.parameters():
            p.normal_(0, 0.3)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3's, so the cache sees normalised keys
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


@contextmanager
def _positions_fed(model):
    """The number of positions each forward hands the backbone (a hook on it: what it computes)."""
    fed = []
    handle = model.base_model.register_forward_pre_hook(lambda _m, _a, kw: fed.append(kw["input_ids"].shape[1]),
                                                        with_kwargs=True)
    try:
        yield fed
    finally:
        handle.remove()


def _prompt(batch=2, length=10, seed=1, vocab=VOCAB):
    span = torch.randint(1, vocab, (batch, length // 2), generator=torch.Generator().manual_seed(seed))
    return torch.cat([span, span], dim=1)  # repeats, so the copy head has matches


def _generate(model, prompt, use_cache, max_new_tokens=6, **kwargs):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                          use_cache=use_cache, **kwargs)


CASES = [(kind, mix, paste, 1 + i % 2, ROPES[i % 4]) for kind in ("llama", "gpt2")
         for i, (mix, paste) in enumerate((m, p) for m in MIXES for p in PASTES)]
CASES += [("qwen3", mix, PASTES[i % 2], 2 - i % 2, ROPES[(i + 1) % 4]) for i, mix in enumerate(MIXES)]


@pytest.mark.parametrize("kind,mix,paste,heads,rope", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}h-{ROPES.index(c[4])}" for c in CASES])
def test_the_cached_forward_feeds_only_new_tokens_and_gives_the_uncached_log_probs(kind, mix, paste, heads, rope):
    model, ids = _tiny(kind, mix, paste, heads, rope), _prompt(length=12)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        assert model(input_ids=ids).cache is None  # a plain forward keeps nothing
        with _positions_fed(model) as fed:
            out = model(input_ids=ids[:, :5], use_cache=True)
            parts, cache = [out.logits], out.cache
            for t in range(5, 12):
                out = model(input_ids=ids[:, t:t + 1], cache=cache)
                parts.append(out.logits)
    assert fed == [5] + [1] * 7
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    copy = cache.layers[model.config.num_hidden_layers]
    assert cache.get_seq_length() == copy.get_seq_length() == 12
    assert torch.equal(copy.values[:, 0, :, 0], ids) and copy.keys.dtype == torch.float32
    prompt = ids[:, :8]
    with _positions_fed(model) as cached_fed:
        cached = _generate(model, prompt, True, do_sample=False)
    with _positions_fed(model) as uncached_fed:
        uncached = _generate(model, prompt, False, do_sample=False)
    assert torch.equal(cached, uncached)
    assert cached_fed == [8] + [1] * 5 and uncached_fed == list(range(8, 14))


def test_the_cache_operations_keep_the_copy_head_in_step():
    """batch_repeat_interleave, batch_select_indices, reorder_cache and crop (transformers' Cache
    methods, which generate and its callers apply) act on the copy head's layer with the
    backbone's: what follows is the uncached forward of the sequence the cache now holds."""
    model, ids = _tiny("llama", "joint", "next"), _prompt(batch=2, length=10)
    nxt = torch.tensor([[5], [6], [7], [8]])

    def step(cache, token):
        return model(input_ids=token, cache=cache).logits[:, -1]

    def reference(seqs):
        return model(input_ids=seqs).logits[:, -1]

    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache
        cache.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
        got = step(cache, nxt)
        torch.testing.assert_close(got, reference(torch.cat([ids.repeat_interleave(2, 0), nxt], 1)), rtol=0, atol=1e-5)
        held = torch.cat([ids.repeat_interleave(2, 0), nxt], 1)
        cache.reorder_cache(torch.tensor([3, 0, 0, 2]))
        held = held[[3, 0, 0, 2]]
        torch.testing.assert_close(step(cache, nxt), reference(torch.cat([held, nxt], 1)), rtol=0, atol=1e-5)
        held = torch.cat([held, nxt], 1)
        cache.batch_select_indices(torch.tensor([1, 3]))
        cache.crop(-3)
        held = held[[1, 3], :-3]
        assert cache.get_seq_length() == cache.layers[-1].get_seq_length() == held.shape[1]
        torch.testing.assert_close(step(cache, nxt[:2]), reference(torch.cat([held, nxt[:2]], 1)), rtol=0, atol=1e-5)


EXPORTS = {"gate-next": [],
           "joint-self-2heads-rope-linear": ["copy.mix=joint", "copy.paste=self", "copy.num_heads=2", "copy.rope=true",
                                             "model.rope_scaling={type: linear, factor: 2}"],
           "sentinel-next-2heads-rope-ntk": ["copy.mix=sentinel", "copy.num_heads=2", "copy.rope=true",
                                             "model.rope_scaling={type: ntk, factor: 3}"],
           "qwen3-joint-next-rope": ["model.arch=qwen3", "model.head_dim=24", "copy.mix=joint", "copy.rope=true"]}


def _export_worker(directory):
    """Each EXPORTS model (tiny, its copy head scaled up) exported as tools/export_hf.py does, with
    our decoder's greedy tokens (cplm_dist.evaluation.generation.generate, tools/generate.py's)."""
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.interop.hf.directory import write_hf_dir
    from cplm_dist.model import build_model
    from cplm_dist.model.parallel.sharding import full_state_dict

    init_distributed(1)
    out = {}
    for name, overrides in EXPORTS.items():
        cfg = load_config("tiny", [*overrides, "model.vocab_size=300"])
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.startswith("copy_head."):
                    p.normal_(0, 0.3)
        (Path(directory) / name).mkdir()
        write_hf_dir(full_state_dict([model.state_dict()], model), cfg.model, cfg.copy, Path(directory) / name, torch.float32)
        prompt = _prompt(length=12, vocab=300)
        out[name] = {"prompt": prompt, "greedy": generate(model, prompt, 6).tokens}
    return out


def _same_either_way(model, prompt):
    """Seeded sampling and beam search give the same tokens (and beam scores) cached and not."""
    runs = {}
    for use_cache in (True, False):
        torch.manual_seed(7)
        sampled = _generate(model, prompt, use_cache, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                            num_return_sequences=2)
        beams = _generate(model, prompt, use_cache, num_beams=3, num_return_sequences=2, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
        runs[use_cache] = sampled, beams
    (s1, b1), (s0, b0) = runs[True], runs[False]
    assert s1.shape == (4, prompt.shape[1] + 6) and torch.equal(s1, s0)
    assert b1.sequences.shape == (4, prompt.shape[1] + 6) and torch.equal(b1.sequences, b0.sequences)
    torch.testing.assert_close(b1.sequences_scores, b0.sequences_scores, rtol=0, atol=1e-5)
    assert b1.cache.get_seq_length() == b1.cache.layers[-1].get_seq_length()


def test_an_export_generates_our_greedy_tokens_and_the_same_samples_and_beams_with_the_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    ours = run_ranks(_export_worker, 1, args=(str(tmp_path),))[0]
    for name, r in ours.items():
        assert (tmp_path / name / "copy_mixture.py").is_file()
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True, dtype=torch.float32).eval()
        want = "CPLMQwen3ForCausalLM" if name.startswith("qwen3") else "CPLMForCausalLM"
        assert type(hf).__name__ == want and type(hf).__module__.startswith("transformers_modules"), name
        hf.generation_config.eos_token_id = None  # LlamaConfig's default 2: ours runs the full 6 tokens
        n = r["prompt"].shape[1]
        with _positions_fed(hf) as fed:
            cached = _generate(hf, r["prompt"], True, do_sample=False)[:, n:]
        assert fed == [n] + [1] * 5, name
        assert torch.equal(cached, r["greedy"]), name
        assert torch.equal(_generate(hf, r["prompt"], False, do_sample=False)[:, n:], r["greedy"]), name
        _same_either_way(hf, r["prompt"])


def test_a_gpt2_export_directory_loads_with_its_remote_class_and_caches(tmp_path):
    """The contract of a copy-on GPT-2 export (config.json: GPT2Config's fields, the copy_* ones,
    model_type cplm_gpt2 and its auto_map; GPT2LMHeadModel's weight names plus copy_head.*), here
    written from a random model: it loads with trust_remote_code and generates the same either way."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from cplm_dist.interop.hf.directory import REMOTE_CODE, REMOTE_FILES

    model = _tiny("gpt2", "sentinel", "next", heads=2, rope=ROPES[3])
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_cplm.CPLMGPT2Config",
                          "AutoModelForCausalLM": "modeling_cplm_gpt2.CPLMGPT2ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in REMOTE_FILES:
        shutil.copy2(REMOTE_CODE / name, tmp_path / name)
    assert config["model_type"] == "cplm_gpt2" and config["architectures"] == ["CPLMGPT2ForCausalLM"]
    stock = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in config.items() if not k.startswith("copy_")
                                          and k not in ("auto_map", "architectures", "model_type")}))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names - set(stock.state_dict()) == {"copy_head.q.weight", "copy_head.k.weight", "copy_head.sentinel"}
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "CPLMGPT2ForCausalLM" and type(hf).__module__.startswith("transformers_modules")
    prompt = _prompt()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=prompt).logits, model(input_ids=prompt).logits, rtol=0, atol=0)
    assert torch.equal(_generate(hf, prompt, True, do_sample=False), _generate(hf, prompt, False, do_sample=False))
    _same_either_way(hf, prompt)


def test_a_bf16_cache_keeps_the_ids_exact_and_the_copy_keys_in_float32():
    model = _tiny("llama", "gate", "next", vocab=1000, dtype=torch.bfloat16)
    ids = torch.tensor([[999, 513, 257, 999, 513, 257, 3]])  # above 256 bf16 rounds ids (513 -> 512)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        copy = out.cache.layers[model.config.num_hidden_layers]
        assert torch.equal(copy.values[:, 0, :, 0], ids) and copy.values.dtype == torch.int64
        assert copy.keys.dtype == torch.float32 and out.cache.layers[0].keys.dtype == torch.bfloat16
        step = model(input_ids=torch.tensor([[999]]), cache=out.cache).logits[:, -1]
        full = model(input_ids=torch.cat([ids, torch.tensor([[999]])], 1)).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=0, atol=0.1)  # bf16 backbones, cached and not


def test_padding_and_foreign_caches_are_one_line():
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    model, prompt = _tiny("llama", "gate", "self"), _prompt()
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # row 1 left-padded
    with pytest.raises(ValueError, match=r"^CPLM generate: attention_mask row 1 has a 0 at position 0 \(padding\); .* "
                                         r"generate prompts of different lengths in separate calls"):
        model.generate(prompt, attention_mask=mask, max_new_tokens=2)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with torch.no_grad():
        foreign = llama(input_ids=prompt, use_cache=True, cache=DynamicCache(config=llama.config)).cache
        with pytest.raises(ValueError, match=r"^this cache holds 10 backbone positions but no copy-head state"):
            model(input_ids=prompt[:, :1], cache=foreign)
    assert foreign.get_seq_length() == 10  # refused before anything was written
    with pytest.raises(ValueError, match=r"^CPLM keeps its copy-head state in a dynamic cache, this one has a StaticLayer"):
        _generate(model, prompt, True, cache_implementation="static")


def test_a_chunked_prefill_and_a_continued_cache_generate_the_uncached_tokens():
    """generate's prefill_chunk_size feeds the prompt in chunks; a returned cache continues."""
    model, prompt = _tiny("gpt2", "gate", "next", heads=1, rope=ROPES[2]), _prompt(length=12)
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, use_cache=False)
    with _positions_fed(model) as fed:
        chunked = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, prefill_chunk_size=5)
    assert fed == [5, 5, 2] + [1] * 7 and torch.equal(chunked, want)
    first = _generate(model, prompt, True, max_new_tokens=4, return_dict_in_generate=True)
    seqs = first.sequences
    more = model.generate(seqs, attention_mask=torch.ones_like(seqs), cache=first.cache, max_new_tokens=4)
    assert torch.equal(more, want)
