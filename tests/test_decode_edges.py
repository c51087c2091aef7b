"""The static-cache decoder's edge cases (cplm_dist.model.static_decode), one rank: greedy on
exact ties resolved as the reference's argmax; a model cast after its first generate; a step
with nothing cached refused; the eager fallback taken on compiler errors only; dynamo's settings
scoped to the compiled step; the cache and graphs released; the padded prefill under a dense mask
(no FlexAttention block mask, whose kernel compiles once per shape)."""

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.model.loss import CopyTerms
from cplm_dist.model.next_token import CopyOver, full_log_probs, greedy
from tests.spawn import run_ranks


def test_greedy_breaks_exact_ties_as_the_reference_argmax():
    # a gate giving the LM almost no weight: w.lm + (z - lse) rounds ids 0 and 1 (z 0 and 1e-3) to one value
    z = torch.tensor([[[0.0, 1e-3, -5.0, -6.0, -7.0, -8.0]]])
    terms = CopyTerms(torch.tensor([[0.5]]), None, torch.tensor([[-1e6]]))
    cand = torch.tensor([[[False, False]]])  # nothing pasted: the LM term alone, everywhere
    copy = CopyOver(terms, torch.tensor([[[1.0, 0.0]]]) * cand, torch.tensor([[4, -1]]), cand)
    reference = full_log_probs(z, copy, "gate", 6)[0][:, 0]
    assert reference[0, 0] == reference[0, 1], "the constructed tie"
    token, _ = greedy(z, copy, "gate")
    assert int(token) == int(reference.argmax(-1)) == 0


def _edges_worker():
    import warnings
    from unittest import mock

    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.generation import generate
    from cplm_dist.model import build_model
    from cplm_dist.model import static_decode
    from cplm_dist.model.core_attention import FlexAttention

    init_distributed(1)
    ids = torch.randint(4, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    out = {}

    def attempt(name, fn):
        try:
            out[name] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - each case reports apart
            out[name] = ("error", f"{type(e).__name__}: {e}")

    def cast_after_generate():
        model = build_model(load_config("tiny", [])).eval()
        generate(model, ids, 4, compile=False)
        model.to(torch.bfloat16)
        got = generate(model, ids, 4, compile=False).tokens
        fresh = build_model(load_config("tiny", [])).eval().to(torch.bfloat16)
        decoder = static_decode.decoder_for(model)
        return got, generate(fresh, ids, 4, compile=False).tokens, decoder.dtype, decoder.cache.layers[0].k.dtype

    def step_without_prefill():
        model = build_model(load_config("tiny", [])).eval()
        decoder = static_decode.decoder_for(model, compile=False)
        try:  # refused after the cache was made ready: float positions
            decoder.prefill(list(ids), 4, [torch.zeros(9), torch.zeros(9)])
        except ValueError:
            pass
        assert decoder.cache is not None and decoder.cache.length == 0
        return decoder.step(ids[:, 0])

    def fallback(error):
        model = build_model(load_config("tiny", ["model.num_layers=1"])).eval()
        decoder = static_decode.decoder_for(model, compile=True)
        decoder.prefill(list(ids), 4)

        def fails(*args):
            raise error

        decoder.compiled = fails
        decoder.step(ids[:, 0])
        return decoder.path

    def scoped_settings():
        model = build_model(load_config("tiny", ["model.num_layers=1"])).eval()
        before = (torch._dynamo.config.recompile_limit, warnings.warn in torch._dynamo.config.ignore_logging_functions)
        inside = []

        def fake_compile(fn, **kw):
            def run(*args):
                inside.append((torch._dynamo.config.recompile_limit,
                               warnings.warn in torch._dynamo.config.ignore_logging_functions))
                return fn(*args)
            return run

        with mock.patch.object(torch, "compile", fake_compile):
            generate(model, ids, 3, compile=True)
        after = (torch._dynamo.config.recompile_limit, warnings.warn in torch._dynamo.config.ignore_logging_functions)
        return before, inside[0], after, model.__dict__["_static_decoder"].path

    def release():
        model = build_model(load_config("tiny", [])).eval()
        first = generate(model, ids, 4, compile=False).tokens
        decoder = static_decode.decoder_for(model)
        static_decode.release(model)
        gone = (decoder.cache is None, decoder.compiled is None, "_static_decoder" not in model.__dict__)
        return gone, torch.equal(generate(model, ids, 4, compile=False).tokens, first)

    def padded_prefill_masks():
        model = build_model(load_config("tiny", [])).eval()
        flex, seen = FlexAttention(), []
        record = flex.__call__

        class Recording(FlexAttention):
            def __call__(self, q, k, v, masks):
                seen.append(masks.block is None)
                return record(q, k, v, masks)

        kernel = Recording()
        model.core_attention = kernel
        for layer in model.layers:
            layer.attention.core = kernel
        rows = [ids[0, :5], ids[1]]  # unequal: padded
        got = generate(model, rows, 3, compile=False).tokens
        alone = torch.stack([generate(model, r[None], 3, compile=False).tokens[0] for r in rows])
        return all(seen), torch.equal(got, alone)

    attempt("cast", cast_after_generate)
    attempt("empty_step", step_without_prefill)
    attempt("fallback_dynamo", lambda: fallback(torch._dynamo.exc.Unsupported("not traceable")))
    attempt("fallback_oom", lambda: fallback(torch.OutOfMemoryError("out of memory")))
    attempt("fallback_other", lambda: fallback(ValueError("a bug")))
    attempt("scoped", scoped_settings)
    attempt("release", release)
    attempt("padded", padded_prefill_masks)
    return out


@pytest.fixture(scope="module")
def edges():
    return run_ranks(_edges_worker, 1, timeout=300)[0]


def test_a_model_cast_after_its_first_generate_decodes_as_one_cast_before(edges):
    status, value = edges["cast"]
    assert status == "ok", value
    got, fresh, dtype, cache_dtype = value
    assert torch.equal(got, fresh) and dtype == cache_dtype == torch.bfloat16


def test_a_step_with_nothing_cached_is_refused(edges):
    status, value = edges["empty_step"]
    assert status == "error" and value.startswith("RuntimeError") and "prefill" in value, value


def test_the_eager_fallback_is_taken_on_compiler_errors_only(edges):
    assert edges["fallback_dynamo"] == ("ok", "eager")
    assert edges["fallback_oom"][0] == "error" and "OutOfMemoryError" in edges["fallback_oom"][1]
    assert edges["fallback_other"] == ("error", "ValueError: a bug")


def test_dynamo_settings_hold_inside_the_compiled_step_only(edges):
    status, value = edges["scoped"]
    assert status == "ok", value
    before, inside, after, path = value
    assert path == "compiled"
    assert inside[0] >= 64 and inside[1], "the recompile limit raised and warnings.warn ignored while the step runs"
    assert after == before, "dynamo's process-wide settings are as they were"


def test_release_frees_the_cache_and_graphs(edges):
    status, value = edges["release"]
    assert status == "ok", value
    assert value == ((True, True, True), True)


def test_a_padded_prefill_attends_under_a_dense_mask(edges):
    status, value = edges["padded"]
    assert status == "ok", value
    assert value == (True, True), "no FlexAttention block mask (a compile per prompt shape on CUDA); rows as alone"
