"""The static-cache decoder (cplm_dist.model.static_decode) against the uncached full-prefix
argmax: every mix and paste mode, copy off, the three backbones, document masking, chunked
prefill, a batch of unequal prompts against each prompt alone, at tp = 1 and 2; and the compiled
step: the same tokens as the eager one, greedy and sampled, and actually compiled (one graph, no
fallback), at tp = 1 and 2."""

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks

VARIANTS = {
    "gate-next": [], "joint-self-rope": ["copy.mix=joint", "copy.paste=self", "copy.rope=true"],
    "sentinel-2heads": ["copy.mix=sentinel", "copy.num_heads=2"], "off": ["copy.enabled=false"],
    "gpt2": ["model.arch=gpt2"], "qwen3": ["model.arch=qwen3"],
}
NEW = 6


def reference(model, ids: torch.Tensor, new: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy tokens of the whole prefix recomputed every step (no cache)."""
    out = []
    for _ in range(new):
        nxt = model.next_token_logprobs(ids, position_ids=positions)[:, -1].argmax(-1)
        out.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if positions is not None:
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return torch.stack(out, dim=1)


def _prompts(g):
    span = torch.randint(4, 512, (2, 6), generator=g)
    return torch.cat([span, span, span[:, :3]], dim=1)  # (2, 15): something to copy


def _eager_worker(tp):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.model import build_model

    init_distributed(tp)
    out = {}
    for name, overrides in VARIANTS.items():
        model = build_model(load_config("tiny", overrides + [f"parallel.tp={tp}"])).eval()
        ids = _prompts(torch.Generator().manual_seed(5))
        got = generate(model, ids, NEW, compile=False, mark_copies=True)
        rows = [ids[0, :9], ids[1]]  # unequal: 9 and 15 tokens
        alone = [generate(model, r[None], NEW, compile=False).tokens[0] for r in rows]
        out[name] = {"reference": reference(model, ids, NEW), "static": got.tokens, "copied": got.copied,
                     "chunked": generate(model, ids, NEW, compile=False, prefill_chunk=4).tokens,
                     "unequal": generate(model, rows, NEW, compile=False).tokens, "alone": torch.stack(alone),
                     "path": model.__dict__["_static_decoder"].path}
    # document masking: a packed prompt (a restart at 7), the new tokens continuing its last document
    model = build_model(load_config("tiny", [f"parallel.tp={tp}"])).eval()
    ids = _prompts(torch.Generator().manual_seed(6))
    positions = torch.cat([torch.arange(7), torch.arange(8)]).expand(2, 15)
    out["documents"] = {"reference": reference(model, ids, NEW, positions),
                        "static": generate(model, ids, NEW, compile=False, position_ids=positions).tokens,
                        "last-alone": generate(model, ids[:, 7:], NEW, compile=False).tokens}
    return out


@pytest.fixture(scope="module")
def eager():
    return {tp: run_ranks(_eager_worker, tp, args=(tp,), timeout=300) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_static_greedy_equals_the_uncached_argmax(eager, tp, variant):
    for rank in eager[tp]:
        r = rank[variant]
        assert r["path"] == "eager"
        assert torch.equal(r["static"], r["reference"]), (variant, tp)
        assert torch.equal(r["chunked"], r["reference"]), "a chunked prefill decodes the same"
        assert (r["copied"] is None) == (variant == "off")
        assert torch.equal(r["static"], eager[1][0][variant]["static"]), "every tp and rank the same tokens"


@pytest.mark.parametrize("tp", [1, 2])
def test_unequal_prompts_in_one_batch_decode_as_each_alone(eager, tp):
    for rank in eager[tp]:
        for variant, r in rank.items():
            if variant != "documents":
                assert torch.equal(r["unequal"], r["alone"]), (variant, tp)
                assert torch.equal(r["unequal"][1], r["static"][1]), (variant, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_document_masking_decodes_the_last_document_alone(eager, tp):
    for rank in eager[tp]:
        r = rank["documents"]
        assert torch.equal(r["static"], r["reference"])
        assert torch.equal(r["static"], r["last-alone"]), "the new tokens see their own document only"


def _compiled_worker(tp):
    from torch._dynamo.utils import counters

    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.model import build_model

    init_distributed(tp)
    model = build_model(load_config("tiny", [f"parallel.tp={tp}", "model.num_layers=1"])).eval()
    ids = _prompts(torch.Generator().manual_seed(7))
    eager = generate(model, ids, NEW, compile=False, mark_copies=True)
    compiled = generate(model, ids, NEW, compile=True, mark_copies=True)
    decoder = model.__dict__["_static_decoder"]
    out = {"reference": reference(model, ids, NEW), "eager": eager, "compiled": compiled, "path": decoder.path,
           "breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
           "compile_seconds": dict(decoder.compile_seconds)}
    again = generate(model, ids[:, :11], NEW, compile=True, mark_copies=True)  # another prompt, the same bucket
    out["again"] = (again.tokens, reference(model, ids[:, :11], NEW))
    out["graphs_after"] = counters["stats"]["unique_graphs"]
    if tp == 1:  # sampled with a seed: the eager decoder's tokens (one more graph: the full distribution)
        kw = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 3}
        sampled = generate(model, ids, NEW, compile=True, **kw).tokens
        out["sampled_path"] = decoder.path
        out["sampled"] = (sampled, generate(model, ids, NEW, compile=False, **kw).tokens)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_the_compiled_step_is_taken_and_decodes_the_eager_tokens(tp):
    for r in run_ranks(_compiled_worker, tp, args=(tp,), timeout=400):
        assert r["path"] == "compiled", "the compiled step fell back to eager"
        assert r["breaks"] == 0 and r["graphs"] == 1, "one graph for the whole step"
        assert list(r["compile_seconds"]) == [(2, 128, True, True)], "compiled once for its (batch, bucket, mode)"
        assert torch.equal(r["compiled"].tokens, r["eager"].tokens) and torch.equal(r["compiled"].tokens, r["reference"])
        assert torch.equal(r["compiled"].copied, r["eager"].copied)
        assert torch.equal(*r["again"])
        if tp == 1:
            assert r["sampled_path"] == "compiled" and torch.equal(*r["sampled"])
            assert r["graphs_after"] == 1, "a second prompt of the same bucket and batch reuses the graph"
