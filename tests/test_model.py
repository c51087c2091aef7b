"""The whole model at tp = 1, 2 and 4 on gloo: one seed gives the same per-token nll and the same
gathered gradients, for every mix and paste mode and with the copy head off, on the three backbones
(llama, gpt2, qwen3); the evaluation distribution sums to one and reproduces the training nll; the
analytic parameter count is exact, and every layer is built from the shapes counting reads."""

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.model.counting import parameter_count
from cplm_dist.model.layer_shapes import layer_shapes
from cplm_dist.model.parallel.sharding import full_shape, gather_full, spec_of
from tests.spawn import run_ranks

VARIANTS = {
    "copy-off": ["copy.enabled=false"],
    "copy-off-padded-untied": ["copy.enabled=false", "model.vocab_size=300", "model.tie_embeddings=false"],
    # copy.chunk_size=5 < T = 24: these variants run the chunked copy head, the others the dense one
    "gate-next-2heads-rope": ["copy.mix=gate", "copy.paste=next", "copy.num_heads=2", "copy.rope=true", "copy.chunk_size=5"],
    "gate-self": ["copy.mix=gate", "copy.paste=self"],
    # the gate reading the trunk's state detached: the same forward, no gradient into the trunk from the gate
    "gate-self-detached": ["copy.mix=gate", "copy.paste=self", "copy.gate_detach=true"],
    "joint-next": ["copy.mix=joint", "copy.paste=next"],
    # vocab 300 pads to 384 at tp=1 and 512 at tp=2, 4: the padding must not change the model
    "joint-self-padded-untied": ["copy.mix=joint", "copy.paste=self", "model.vocab_size=300", "model.tie_embeddings=false",
                                 "copy.chunk_size=5"],
    "sentinel-next-2heads": ["copy.mix=sentinel", "copy.paste=next", "copy.num_heads=2", "copy.chunk_size=7"],
    "sentinel-self": ["copy.mix=sentinel", "copy.paste=self"],
    "joint_gate-next-2heads": ["copy.mix=joint_gate", "copy.paste=next", "copy.num_heads=2", "copy.chunk_size=5"],
    # the gate shut (g = sigmoid(40)): the copy weight at 0, so the copy model must be the baseline
    "gate-shut": ["copy.mix=gate", "copy.gate_bias_init=40"],
    # the GPT-2 backbone: LayerNorm with bias, GELU MLP, learned positions, biases (grouped and plain heads)
    "gpt2-gate-next": ["model.arch=gpt2", "copy.mix=gate", "copy.paste=next", "copy.chunk_size=5"],
    "gpt2-mha-copy-off-untied": ["model.arch=gpt2", "model.num_kv_heads=8", "copy.enabled=false", "model.tie_embeddings=false"],
    # the Qwen3 backbone: queries and keys RMS-normalised per head before RoPE (weights shared by the heads,
    # replicated over tp), heads of model.head_dim = 24 (q 192 wide beside hidden 128)
    "qwen3-gate-next": ["model.arch=qwen3", "model.head_dim=24", "copy.mix=gate", "copy.paste=next", "copy.chunk_size=5"],
}
# loss.impl=chunked (blocks of 7 of the 48 rows) beside the dense variant it must equal
CHUNKED_LOSS = {f"{name}+chunked-loss": name for name in ("copy-off-padded-untied", "joint-next", "sentinel-next-2heads")}
VARIANTS.update({chunked: VARIANTS[dense] + ["loss.impl=chunked", "loss.chunk_rows=7"] for chunked, dense in CHUNKED_LOSS.items()})
# Megatron sequence parallelism at tp = 2, 4 against the same variant at tp = 1: every mix, the
# dense (gate-self) and chunked copy paths, copy off, both LM-side losses
SEQUENCE_PARALLEL = {f"{name}+sp": name for name in (
    "copy-off-padded-untied", "gate-next-2heads-rope", "gate-self", "gate-self-detached", "joint-self-padded-untied", "sentinel-next-2heads",
    "joint_gate-next-2heads", "copy-off-padded-untied+chunked-loss", "joint-next+chunked-loss", "gpt2-gate-next", "gpt2-mha-copy-off-untied",
    "qwen3-gate-next")}
TPS = (1, 2, 4)


def batch(vocab):
    """Two sequences, each a random span then its repeat, so the copy head has matches."""
    g = torch.Generator().manual_seed(11)
    span = torch.randint(0, vocab, (2, 12), generator=g)
    return torch.cat([span, span], dim=1)  # (2, 24)


def _model_worker(tp):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model

    dims = init_distributed(tp)
    results = {}
    variants = dict(VARIANTS)
    if tp > 1:
        variants.update({sp: VARIANTS[name] + ["parallel.sequence_parallel=true"] for sp, name in SEQUENCE_PARALLEL.items()})
    for name, overrides in variants.items():
        cfg = load_config("tiny", overrides + [f"parallel.tp={tp}"])
        model = build_model(cfg)
        assert model.sequence_parallel == (name in SEQUENCE_PARALLEL), name
        ids = batch(cfg.model.vocab_size)
        out = model(ids)
        weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)  # distinct weight per token
        (out.nll * weights).sum().backward()
        grads, params = {}, {}
        for pname, p in model.named_parameters():
            spec = spec_of(p)
            rows = spec.full_rows or None
            grads[pname] = gather_full(p.grad, spec, dims.tp_group)[:rows]
            params[pname] = gather_full(p.data, spec, dims.tp_group)[:rows]
        results[name] = {"nll": out.nll.detach(), "copy_share": out.copy_share, "grads": grads, "params": params,
                         "layer": [(n, full_shape(p.shape, spec_of(p), tp), spec_of(p).dim, spec_of(p).stride)
                                   for n, p in model.layers[0].named_parameters()]}
        if name in SEQUENCE_PARALLEL:
            continue  # a sequence-parallel model trains only
        logprobs = model.next_token_logprobs(ids)
        at_labels = logprobs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        # CPLM.score: the same values at the targets, never gathering the vocabulary, 3 positions a
        # block (rows=7 over 2 sequences); the argmax as targets must all be greedy; a continuation
        # after a prefix's state
        argmax = logprobs[:, :-1].argmax(-1)
        prefix = model.new_decode_state(*ids.shape)
        first = model.score(ids[:, :10], ids[:, 1:11], prefix, rows=7)
        rest = model.score(ids[:, 10:-1], ids[:, 11:], prefix, rows=7)
        results[name].update({
            "lm_nll": out.lm_nll,
            "numel": sum(p.numel() for p in model.parameters()),
            "logprob_sum": logprobs.exp().sum(-1),
            "logprob_at_labels": at_labels,
            "greedy_at_labels": argmax == ids[:, 1:],
            "vocab_cols": logprobs.shape[-1],
            "score": model.score(ids[:, :-1], ids[:, 1:], rows=7),
            "score_of_argmax": model.score(ids[:, :-1], argmax, rows=7),
            "score_continued": (torch.cat([first[0], rest[0]], 1), torch.cat([first[1], rest[1]], 1)),
        })
    return results


@pytest.fixture(scope="module")
def runs():
    return {tp: run_ranks(_model_worker, tp, args=(tp,), timeout=400) for tp in TPS}


@pytest.mark.parametrize("tp", TPS)
def test_a_detached_gate_trains_its_own_linear_and_never_the_trunk(runs, tp):
    """copy.gate_detach: the forward and the gate's, the copy head's and the LM head's own gradients
    are the gate's; only the trunk's gradients change (they lose the gate's path)."""
    plain, detached = runs[tp][0]["gate-self"], runs[tp][0]["gate-self-detached"]
    torch.testing.assert_close(detached["nll"], plain["nll"], rtol=0, atol=0)
    for name, grad in plain["grads"].items():
        if name.startswith(("copy_head.", "final_norm.")) or name == "embedding.weight":
            continue  # the tied embedding and the final norm take the trunk's gradient too
        if name.startswith("layers."):
            assert not torch.allclose(detached["grads"][name], grad, atol=1e-9), name
    for name in ("copy_head.gate.weight", "copy_head.gate.bias", "copy_head.q.weight", "copy_head.k.weight"):
        torch.testing.assert_close(detached["grads"][name], plain["grads"][name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS) + sorted(SEQUENCE_PARALLEL))
def test_same_model_same_nll_and_gradients_at_every_tp(runs, tp, variant):
    """Also with sequence parallelism: per-token nll and every gathered gradient equal tp = 1's
    (the norm and copy-head weights, which see T/tp positions a rank, summed over tp)."""
    one = runs[1][0][SEQUENCE_PARALLEL.get(variant, variant)]
    for rank, res in enumerate(runs[tp]):
        got = res[variant]
        for name, full in one["params"].items():
            torch.testing.assert_close(got["params"][name], full, rtol=0, atol=0, msg=f"init of {name}, rank {rank}")
        torch.testing.assert_close(got["nll"], one["nll"], rtol=1e-5, atol=1e-6, msg=f"nll, rank {rank}")
        torch.testing.assert_close(got["copy_share"], one["copy_share"], rtol=1e-5, atol=1e-6)
        for name, g in one["grads"].items():
            scale = g.abs().max().item()
            assert scale > 0, f"{name} got no gradient"
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-5 * scale, msg=f"grad {name}, rank {rank}")


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_next_token_logprobs_sum_to_one_and_reproduce_nll(runs, tp, variant):
    res = runs[tp][0][variant]
    vocab = load_config("tiny", VARIANTS[variant]).model.vocab_size
    assert res["vocab_cols"] == vocab, "padded ids must not appear in the distribution"
    torch.testing.assert_close(res["logprob_sum"], torch.ones_like(res["logprob_sum"]), rtol=0, atol=2e-5)
    # two code paths: the training loss (A_t, M_t, vocab-parallel LSE) and the full distribution
    torch.testing.assert_close(-res["logprob_at_labels"], res["nll"][:, :-1], rtol=1e-5, atol=2e-5)
    assert (res["nll"][:, -1] == 0).all(), "the last position has no label and is ignored"


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_score_reads_the_distribution_at_the_targets_without_gathering_it(runs, tp, variant):
    """CPLM.score (vocab-parallel target log-prob and argmax, in blocks of positions, fresh or
    after a decode state) against the gathered distribution of tp = 1."""
    one, res = runs[1][0][variant], runs[tp][0][variant]
    for key in ("score", "score_continued"):
        logp, greedy = res[key]
        torch.testing.assert_close(logp, one["logprob_at_labels"], rtol=1e-5, atol=2e-5, msg=key)
        assert torch.equal(greedy, one["greedy_at_labels"]), key
    logp, greedy = res["score_of_argmax"]
    assert greedy.all() and (logp < 0).all()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_analytic_parameter_count_equals_the_module(runs, variant):
    cfg = load_config("tiny", VARIANTS[variant])
    assert runs[1][0][variant]["numel"] == parameter_count(cfg, padded=True)["total"]
    assert sum(p.numel() for p in runs[1][0][variant]["params"].values()) == parameter_count(cfg)["total"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_layer_is_built_from_its_shapes(runs, tp, variant):
    """Every parameter of a built layer, in order, is an entry of layer_shapes (what counting and the
    memory estimator read): its name, full shape and tp split; a new slot is counted as it is built."""
    cfg = load_config("tiny", VARIANTS[variant])
    want = [(s.name, s.shape, s.split, s.stride) for s in layer_shapes(cfg.model)]
    assert runs[tp][0][variant]["layer"] == want


def test_copy_head_learns_nothing_yet_but_shares_mass(runs):
    """At init every copy-on variant gives the copy side some mass, copy-off none; the mixture's
    nll differs from the LM head's alone exactly where the copy side has mass."""
    for name, res in runs[1][0].items():
        if name == "gate-shut":
            continue
        share = res["copy_share"][:, 1:-1]
        if "copy.enabled=false" in VARIANTS[name]:
            assert (res["copy_share"] == 0).all() and torch.equal(res["nll"], res["lm_nll"])
        else:
            assert (share > 0.001).all() and (share < 0.999).all(), name
            assert not torch.allclose(res["nll"], res["lm_nll"]), name


@pytest.mark.parametrize("tp", TPS)
def test_copy_on_with_its_weight_at_zero_is_the_copy_off_baseline(runs, tp):
    """Copy on and copy off share every line of loss code but the copy terms: with the gate shut
    the copy model's nll and every backbone gradient equal the baseline's, and the copy head's
    own gradients vanish."""
    shut, off = runs[tp][0]["gate-shut"], runs[tp][0]["copy-off"]
    assert float(shut["copy_share"].max()) < 1e-12
    torch.testing.assert_close(shut["nll"], off["nll"], rtol=0, atol=1e-6)
    torch.testing.assert_close(shut["lm_nll"], off["lm_nll"], rtol=0, atol=0)
    for name, g in off["grads"].items():
        torch.testing.assert_close(shut["grads"][name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(), msg=name)
    copy_grads = [g for name, g in shut["grads"].items() if name.startswith("copy_head.")]
    assert copy_grads and max(float(g.abs().max()) for g in copy_grads) < 1e-9


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("chunked", sorted(CHUNKED_LOSS))
def test_the_chunked_loss_is_the_dense_loss_in_the_model(runs, tp, chunked):
    """loss.impl=chunked through the whole model (tied and untied LM head, padded vocabulary, copy
    off and on): the same nll and every parameter's gradient as loss.impl=dense at the same tp."""
    for rank, res in enumerate(runs[tp]):
        got, want = res[chunked], res[CHUNKED_LOSS[chunked]]
        torch.testing.assert_close(got["nll"], want["nll"], rtol=1e-6, atol=1e-6, msg=f"nll, rank {rank}")
        for name, g in want["grads"].items():
            scale = g.abs().max().item()
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6 * scale, msg=f"grad {name}, rank {rank}")


# --- pipeline stages ---------------------------------------------------------------------------


def test_pipeline_partition_is_the_balanced_one():
    """Against brute force: contiguous stages, the embedding's layer first, the head last, at
    least one transformer layer per stage, the heaviest stage as light as possible."""
    import itertools
    import random

    from cplm_dist.model.parallel.stages import partition

    rng = random.Random(0)
    for _ in range(200):
        n, stages = rng.randint(4, 9), rng.randint(2, 4)
        if n - 2 < stages:
            continue
        weights = [rng.randint(1, 50) for _ in range(n)]
        best = min(max(sum(weights[a:b]) for a, b in zip((0, *cut), (*cut, n)))
                   for cut in itertools.combinations(range(2, n - 1), stages - 1))
        bounds = partition(weights, stages)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == stages + 1
        assert bounds[1] >= 2 and bounds[-2] <= n - 2 and all(b < c for b, c in zip(bounds, bounds[1:]))
        assert max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])) == best, (weights, stages, bounds)


def test_pipeline_stages_of_the_shipped_sizes():
    from cplm_dist.model.parallel.stages import stage_bounds, stage_transformer_layers

    for name, pp in (("cplm-1.7b", 2), ("cplm-70b", 8), ("tiny", 2)):
        cfg = load_config(name, [])
        layers = stage_transformer_layers(cfg, pp)
        assert sum(layers) == cfg.model.num_layers and min(layers) >= 1
        # the LM head (V x D) weighs as several layers: the last stage runs fewer of them
        assert layers[-1] <= layers[0], (name, layers)
        assert stage_bounds(cfg, pp)[-1] == cfg.model.num_layers + 2 + cfg.model.tie_embeddings


# --- a sparse model (model.moe): its layers are built from their shapes too ---------------------------

SPARSE = {
    "moe-shared-gate": ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.shared_ffn_hidden_size=64",
                        "model.moe.shared_gate=true"],
    "moe-gpt2-first-dense": ["model.arch=gpt2", "model.moe.num_experts=4", "model.moe.top_k=1",
                             "model.moe.normalize=false", "model.moe.ffn_hidden_size=64", "model.moe.first_dense_layers=1"],
}


def _sparse_worker(tp):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model

    dims = init_distributed(tp)
    out = {}
    for name, overrides in SPARSE.items():
        cfg = load_config("tiny", overrides + [f"parallel.tp={tp}"] + (["parallel.sequence_parallel=true"] if tp > 1 else []))
        model = build_model(cfg)
        out[name] = {
            "layers": [[(n, full_shape(p.shape, spec_of(p), tp), spec_of(p).dim, spec_of(p).stride)
                        for n, p in layer.named_parameters()] for layer in model.layers],
            "numel": sum(p.numel() for p in model.parameters()),
            "params": {n: gather_full(p.data, spec_of(p), dims.tp_group) for n, p in model.named_parameters()},
        }
    return out


@pytest.fixture(scope="module")
def sparse_runs():
    return {tp: run_ranks(_sparse_worker, tp, args=(tp,), timeout=400) for tp in (1, 2)}


@pytest.mark.parametrize("variant", sorted(SPARSE))
def test_a_sparse_layer_is_built_from_its_shapes_and_counted(sparse_runs, variant):
    """Router, experts by global id and the shared expert as layer_shapes has them at tp 1 and at
    tp 2 with sequence parallelism (the experts split over expert_tp = tp), dense layers beside
    them; the analytic count is the module's, and the model is the same at both tp (each rank
    holds its shard of one seeded tensor)."""
    cfg = load_config("tiny", SPARSE[variant])
    for tp, ranks in sparse_runs.items():
        for i, built in enumerate(ranks[0][variant]["layers"]):
            assert built == [(s.name, s.shape, s.split, s.stride) for s in layer_shapes(cfg.model, i)], (tp, i)
    assert sparse_runs[1][0][variant]["numel"] == parameter_count(cfg, padded=True)["total"]
    one = sparse_runs[1][0][variant]["params"]
    for rank in sparse_runs[2]:
        for name, full in one.items():
            torch.testing.assert_close(rank[variant]["params"][name], full, rtol=0, atol=0, msg=name)
