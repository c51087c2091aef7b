"""The copy head and both mixing paths (training: A_t, M_t -> nll; evaluation: the full
distribution) against the mixture written out position by position (tests/reference.py)."""

import json
import math

import pytest
import torch

import cplm_dist.model.loss as vp
from cplm_dist.config import CopyConfig, ModelConfig
from cplm_dist.errors import ConfigError
from cplm_dist.model.copy_head import CopyHead
from cplm_dist.model.copy_lse import candidate_mask, chunked_copy_lse, dense_copy_lse, masked_logsumexp
from tests import reference

B, T, D, V = 2, 9, 16, 7  # a small vocabulary, so that context tokens repeat and get pasted
CASES = [(mix, paste, heads) for mix in ("gate", "joint", "sentinel", "joint_gate") for paste in ("next", "self") for heads in (1, 3)]


def make_head(mix, paste, heads, rope=False, seed=0, impl="chunked", chunk_size=4):
    torch.manual_seed(seed)
    head = CopyHead(ModelConfig(hidden_size=D), CopyConfig(num_heads=heads, head_dim=8, mix=mix, paste=paste, rope=rope,
                                                           impl=impl, chunk_size=chunk_size))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    return head


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.cat([ids[:, 1:], torch.randint(0, V, (B, 1), generator=g)], dim=1)
    labels[1, 4] = vp.IGNORE_INDEX
    logits = torch.randn(B, T, V, generator=g)
    return h, ids, labels, logits


def per_head_parts(head, h):
    q, k = head.project(h)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head.head_dim)  # (B, H, T, T)
    if head.cfg.mix in ("gate", "joint_gate"):
        gate = head.gate(h).squeeze(-1)  # (B, T)
    elif head.cfg.mix == "sentinel":
        gate = torch.einsum("bhtd,hd->bht", q, head.sentinel) / math.sqrt(head.head_dim)  # (B, H, T)
    else:
        gate = torch.zeros(B, T)
    return scores.detach(), gate.detach()


@pytest.mark.parametrize("impl", ["chunked", "dense"])
@pytest.mark.parametrize("mix,paste,heads", CASES)
def test_copy_terms_match_reference(mix, paste, heads, impl):
    head = make_head(mix, paste, heads, impl=impl)
    h, ids, labels, _ = inputs()
    terms = head(h, ids, labels)
    scores, _ = per_head_parts(head, h)
    for b in range(B):
        a_ref, m_ref = reference.copy_terms(scores[b], ids[b], labels[b], mix, paste)
        torch.testing.assert_close(terms.copy_all[b].double(), a_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(terms.copy_match[b].double(), m_ref, rtol=1e-5, atol=1e-5)
    if paste == "next":
        assert torch.isinf(terms.copy_all[:, 0]).all(), "position 0 has no candidate in next mode"


@pytest.mark.parametrize("mix,paste,heads", CASES)
def test_training_and_evaluation_paths_match_the_written_out_mixture(mix, paste, heads):
    head = make_head(mix, paste, heads, rope=heads == 3)
    h, ids, labels, logits = inputs(seed=2)
    scores, gate = per_head_parts(head, h)
    # evaluation path: the full next-token distribution
    weights, src, terms = head.position_weights(h, ids)
    copy_lp = vp.scatter_copy_log_probs(weights, src, V)
    log_probs, _ = vp.mixed_log_probs(logits, copy_lp, terms, mix)
    # training path: per-token nll from A_t, M_t
    nll = vp.mixed_nll(logits, labels, head(h, ids, labels), mix).nll
    for b in range(B):
        ref = reference.next_token_distribution(logits[b], scores[b], gate[b], ids[b], mix, paste)
        torch.testing.assert_close(log_probs[b].exp().double(), ref, rtol=1e-5, atol=1e-6)
        keep = labels[b] != vp.IGNORE_INDEX
        ref_nll = -torch.log(ref[keep].gather(1, labels[b][keep][:, None]).squeeze(1))
        torch.testing.assert_close(nll[b][keep].double(), ref_nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(B, T))


@pytest.mark.parametrize("mix", ["gate", "joint", "sentinel", "joint_gate"])
def test_gradients_are_finite_through_empty_rows(mix):
    head = make_head(mix, "next", 2)
    h, ids, labels, logits = inputs(seed=3)
    h.requires_grad_(True)
    terms = head(h, ids, labels)
    vp.mixed_nll(logits, labels, terms, mix).nll.sum().backward()
    assert torch.isfinite(h.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in head.parameters())
    assert h.grad.abs().sum() > 0


@pytest.mark.parametrize("mix", ["joint", "sentinel"])
def test_a_detached_gate_needs_a_gate_of_h(mix):
    from cplm_dist.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^copy\.gate_detach=true needs a gate read from h .* not copy\.mix={mix}:"):
        CopyHead(ModelConfig(hidden_size=D), CopyConfig(mix=mix, gate_detach=True))
    assert CopyHead(ModelConfig(hidden_size=D), CopyConfig(mix="joint_gate", gate_detach=True)).gate_detach


def test_masked_logsumexp_empty_rows_have_zero_gradient():
    x = torch.randn(3, 5, requires_grad=True)
    mask = torch.tensor([[True] * 5, [False] * 5, [True, False, True, False, False]])
    out = masked_logsumexp(x, mask, dim=-1)
    assert out[1] == -math.inf
    torch.testing.assert_close(out[[0, 2]], torch.stack([x[0].logsumexp(0), x[2, [0, 2]].logsumexp(0)]))
    out[[0, 2]].sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all() and (x.grad[2, [1, 3, 4]] == 0).all()


# --- the chunked path (cplm_dist.model.copy_lse) against the dense one ---------------------------


def lse_inputs(paste, with_labels, T_=11, heads=2, d=8, seed=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, T_, d, generator=g, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(B, heads, T_, d, generator=g, dtype=torch.float64).requires_grad_(True)
    ids = torch.randint(0, 4, (B, T_), generator=g)
    labels = torch.randint(0, 4, (B, T_), generator=g) if with_labels else None
    if with_labels:
        labels[0, 2] = vp.IGNORE_INDEX
        labels[1, 5] = 99  # a label no candidate pastes: M_t = -inf
    head = make_head("gate", paste, heads, impl="dense")
    return q, k, head.source_ids(ids), labels, head


def finite_weighted_sum(outputs, seed=5):
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for x in outputs:
        if x is not None:
            total = total + (x.masked_fill(~torch.isfinite(x), 0) * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum()
    return total


def assert_same_log_sum_exps(got_pair, want_pair, tol: float) -> None:
    """(A, M) against the reference's: the same empty (-inf) rows, the rest within tol; M None alike."""
    for want, got in zip(want_pair, got_pair):
        if want is None:
            assert got is None
            continue
        assert torch.equal(torch.isfinite(want), torch.isfinite(got)), "the same rows must be empty"
        torch.testing.assert_close(got.masked_fill(~torch.isfinite(got), 0), want.masked_fill(~torch.isfinite(want), 0),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("paste", ["next", "self"])
@pytest.mark.parametrize("with_labels", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 11, 64])
def test_chunked_log_sum_exps_equal_the_dense_path_in_float64(paste, with_labels, chunk):
    q, k, src, labels, head = lse_inputs(paste, with_labels)
    shift = -1 if paste == "next" else 0
    dense = dense_copy_lse(q, k, src, labels, head.shift)
    chunked = chunked_copy_lse(q, k, src, labels, shift, chunk)
    assert_same_log_sum_exps(chunked, dense, tol=1e-12)
    if with_labels:
        assert torch.isinf(dense[1][1, :, 5]).all() and torch.isfinite(dense[1]).any()
    grads = [torch.autograd.grad(finite_weighted_sum(out), [q, k]) for out in (dense, chunked)]
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert grads[1][0].abs().sum() > 0 and grads[1][1].abs().sum() > 0


@pytest.mark.parametrize("paste", ["next", "self"])
def test_chunked_log_sum_exps_pass_gradcheck(paste):
    q, k, src, labels, _ = lse_inputs(paste, True, T_=6)
    shift = -1 if paste == "next" else 0

    def f(q, k):
        return tuple(x.masked_fill(~torch.isfinite(x), 0) for x in chunked_copy_lse(q, k, src, labels, shift, 4))

    assert torch.autograd.gradcheck(f, (q, k))


def test_chunked_empty_rows_pass_nothing_back_whatever_arrives():
    """A row without candidates (A = -inf) gives zero gradient even if inf/nan reaches it, as the
    dense path's guards do."""
    q, k, src, labels, head = lse_inputs("next", True)
    a, m = chunked_copy_lse(q, k, src, labels, -1, 3)
    assert torch.isinf(a[:, :, 0]).all()  # position 0 has no candidate in `next` mode
    grad_a = torch.ones_like(a)
    grad_a[:, :, 0] = float("inf")
    grad_m = torch.where(torch.isfinite(m), 1.0, float("nan")).to(m.dtype)
    got = torch.autograd.grad([a, m], [q, k], [grad_a, grad_m])
    ad, md = dense_copy_lse(q, k, src, labels, head.shift)
    want = torch.autograd.grad([ad, md], [q, k], [grad_a.nan_to_num(posinf=0.0), grad_m.nan_to_num(nan=0.0)])
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)

@pytest.mark.parametrize("impl", ["chunked", "dense"])
def test_only_the_dense_path_keeps_a_score_matrix_for_backward(impl):
    """The chunked path saves q, k and per-row sums; no saved tensor grows with T x T."""
    Tn, heads = 48, 2
    head = make_head("joint", "next", heads, impl=impl, chunk_size=8)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(B, Tn, D, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, Tn), generator=g)
    labels = torch.randint(0, V, (B, Tn), generator=g)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = head(h, ids, labels)
    score_sized = B * heads * Tn * Tn
    if impl == "dense":
        assert max(saved) >= score_sized
    else:
        assert max(saved) < score_sized / 4, f"largest saved tensor {max(saved)} elements"
    (terms.copy_match - terms.copy_all).masked_fill(~torch.isfinite(terms.copy_match), 0).sum().backward()
    assert torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0



def graph_node_names(t: torch.Tensor) -> set[str]:
    names, stack, seen = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("chunk,chunked", [(T, False), (T + 5, False), (T - 1, True), (1, True)])
def test_a_sequence_within_one_block_takes_the_dense_path(chunk, chunked):
    """T <= chunk_size keeps the dense graph (the same peak memory, no recomputation)."""
    head = make_head("gate", "next", 1, chunk_size=chunk)
    h, ids, labels, _ = inputs()
    terms = head(h.requires_grad_(True), ids, labels)
    assert any("ChunkedCopyLSE" in n for n in graph_node_names(terms.copy_match)) == chunked


# --- the flex path (FlexAttention's LSE) against the dense one ------------------------------------
# On CPU FlexAttention runs its unfused reference, forward only; the fused kernel and its backward
# are checked against the chunked path on a GPU (tools/bench_copy_head.py --check in tools/gpu_check.sh).


@pytest.mark.parametrize("paste", ["next", "self"])
@pytest.mark.parametrize("with_labels", [True, False])
@pytest.mark.parametrize("T_,offset", [(11, 0), (300, 0), (140, 160)])
def test_flex_log_sum_exps_equal_the_dense_path(paste, with_labels, T_, offset):
    """Sequences within one 128-block and across several (full and partial blocks), and the
    queries of a sequence-parallel rank (positions offset.. against every key)."""
    q, k, src, labels, head = lse_inputs(paste, with_labels, T_=T_ + offset)
    q = q.detach()[:, :, offset:].float()
    k, labels = k.detach().float(), None if labels is None else labels[:, offset:]
    from cplm_dist.model.copy_lse import flex_copy_lse

    dense = dense_copy_lse(q, k, src, labels, head.shift, offset)
    flex = flex_copy_lse(q, k, src, labels, head.shift, offset)
    assert_same_log_sum_exps(flex, dense, tol=1e-5)
    assert torch.isfinite(dense[0]).any() and (labels is None or torch.isfinite(dense[1]).any())


def test_flex_gradients_through_its_lse_equal_the_dense_path(monkeypatch):
    """FlexAttention's own backward formula takes the gradient of the LSE it returns (what the flex
    path relies on). torch refuses its backward on CPU by a device check only, lifted here to run
    the unfused reference backward; the fused CUDA backward is checked in the GPU check."""
    import torch.nn.attention.flex_attention as fa

    from cplm_dist.model.copy_lse import flex_copy_lse

    monkeypatch.setattr(fa, "_validate_device", lambda *tensors: None)
    q, k, src, labels, head = lse_inputs("next", True, T_=150)
    q, k = q.detach().float().requires_grad_(True), k.detach().float().requires_grad_(True)
    grads = [torch.autograd.grad(finite_weighted_sum(f(q, k, src, labels, head.shift)), [q, k])
             for f in (dense_copy_lse, flex_copy_lse)]
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grads[1][0].abs().sum() > 0 and grads[1][1].abs().sum() > 0


@pytest.fixture
def flex_recorded(tmp_path, monkeypatch):
    """A record that flex ran on a GPU with this torch, as tools/bench_copy_head.py --record-flex
    writes it, read through CPLM_FLEX_RECORD."""
    from cplm_dist.model.flex_record import ENV, write_record

    monkeypatch.setenv(ENV, str(tmp_path / "flex_gpu_record.json"))
    return write_record([{"seq_len": 2048, "max_abs_diff_lse": 2e-6, "max_rel_diff_grad": 3e-5}], 1e-3, "a test GPU")


def test_copy_impl_picks_its_path_and_flex_refuses_to_train_on_cpu(tmp_path, monkeypatch):
    """auto trains chunked on CPU (dense within one block), and on CUDA too until a GPU check has
    recorded flex for this torch; flex is for training only (evaluation takes chunked), and
    training it on CPU is refused with one line."""
    from cplm_dist.model.flex_record import ENV, RECORD, read_record, record_path, torch_minor, write_record

    h, ids, labels, _ = inputs()
    q = torch.zeros(1, 1, T, 8, requires_grad=True)
    assert make_head("joint", "next", 2, impl="auto").lse_path(q, q) == "chunked"
    assert make_head("gate", "next", 1, impl="auto", chunk_size=T).lse_path(q, q) == "dense"
    whole = torch.zeros(1, 1, 256, 8, requires_grad=True)  # where FlexAttention trains: lengths in whole 128-blocks

    def on_cuda():
        head = make_head("joint", "next", 2, impl="auto")
        head._flex_trains_on = lambda device: True
        return head

    monkeypatch.delenv(ENV, raising=False)
    assert record_path() == RECORD  # the record ships beside the code
    record = tmp_path / "flex_gpu_record.json"
    monkeypatch.setenv(ENV, str(record))
    assert read_record() is None and on_cuda().lse_path(whole, whole) == "chunked"  # not run on a GPU: chunked
    write_record([{"seq_len": 2048, "max_abs_diff_lse": 2e-6, "max_rel_diff_grad": 3e-5},
                  {"seq_len": 8192, "max_abs_diff_lse": 4e-6, "max_rel_diff_grad": 1e-5}], 1e-3, "a test GPU")
    saved = read_record()
    assert (saved["device"], saved["torch"], saved["max_abs_diff_lse"], saved["max_rel_diff_grad"]) == (
        "a test GPU", torch_minor(), 4e-6, 3e-5)
    head = on_cuda()
    assert head.lse_path(whole, whole) == "flex" and head.lse_path(q, q) == "chunked"
    record.write_text(json.dumps({**saved, "torch": "1.13"}))  # recorded with another torch: chunked again
    assert read_record() is None and on_cuda().lse_path(whole, whole) == "chunked"
    monkeypatch.setenv(ENV, "")  # none
    assert read_record() is None and torch_minor("2.9.1+cu128") == "2.9"
    flex = make_head("joint", "next", 2, impl="flex")  # chosen outright, record or not
    with torch.no_grad():
        assert flex.lse_path(q, q) == "chunked"
    with pytest.raises(ConfigError, match=r"^copy\.impl=flex trains on CUDA only .*set copy\.impl=auto"):
        flex(h.requires_grad_(True), ids, labels)


def test_only_a_checked_flex_path_is_recorded(capsys):
    from cplm_dist_tools.bench_copy_head import main

    assert main(["--record-flex", "--check", "1e-3"]) == 2  # no flex among the paths
    assert "--record-flex records a checked flex path" in capsys.readouterr().err


def test_auto_goes_on_chunked_when_the_flex_kernel_fails(caplog, flex_recorded):
    """copy.impl=auto whose first flex call fails (here a real failure: told that this CPU trains
    flex, FlexAttention refuses its backward) warns once and trains with chunked's terms and
    gradients, then does not try flex again."""
    want = make_head("joint", "next", 2, impl="chunked")
    auto = make_head("joint", "next", 2, impl="auto")
    auto._flex_trains_on = lambda device: True
    g = torch.Generator().manual_seed(8)
    h, ids = torch.randn(B, 128, D, generator=g), torch.randint(0, V, (B, 128), generator=g)  # one whole flex block
    labels, logits = torch.randint(0, V, (B, 128), generator=g), torch.randn(B, 128, V, generator=g)
    results = []
    for head, calls in ((want, 1), (auto, 2)):
        for _ in range(calls):
            x = h.clone().requires_grad_(True)
            with caplog.at_level("WARNING", logger="cplm_dist.model.copy_head"):
                terms = head(x, ids, labels)
            vp.mixed_nll(logits, labels, terms, "joint").nll.sum().backward()
            results.append((terms, x.grad))
    warnings = [r.getMessage() for r in caplog.records if "FlexAttention kernel failed" in r.getMessage()]
    assert len(warnings) == 1 and "does not support backward on CPU" in warnings[0], warnings
    assert auto.last_path == "chunked" and auto._flex_failed
    for terms, grad in results[1:]:
        for a, b in zip(results[0][0], terms):
            if a is not None:
                torch.testing.assert_close(b, a)
        torch.testing.assert_close(grad, results[0][1])


def test_flex_block_masks_cover_every_candidate_and_evaluate_the_match_everywhere():
    """The kernel skips the blocks a BlockMask leaves out and does not evaluate mask_mod inside
    its full blocks, which CPU's unfused reference ignores: so the structure is checked here.
    The candidate mask's visible blocks cover every candidate; the match mask has the same
    blocks, none of them full (src == y is evaluated in each)."""
    from cplm_dist.model.copy_lse import candidate_block_mask, match_block_mask

    for Tq, Tk, limit in [(300, 300, -1), (140, 300, 159), (11, 11, 0), (1, 1, -1), (257, 257, 0)]:
        full, _ = candidate_block_mask(Tq, Tk, limit, torch.device("cpu"))
        match = match_block_mask(Tq, Tk, limit, torch.device("cpu"), lambda b, h, q_idx, kv_idx: kv_idx >= 0)
        assert match.full_kv_num_blocks is None
        assert torch.equal(match.to_dense(), full.to_dense())
        bq, bk = full.BLOCK_SIZE
        cand = candidate_mask(torch.arange(Tq), Tk, limit)  # [t, j] = j <= t + limit
        padded = torch.zeros(-(-Tq // bq) * bq, -(-Tk // bk) * bk, dtype=torch.bool)
        padded[:Tq, :Tk] = cand
        holds = padded.unflatten(0, (-1, bq)).unflatten(2, (-1, bk)).any(dim=3).any(dim=1)  # (q blocks, kv blocks)
        assert torch.equal(full.to_dense()[0, 0].bool(), holds), (Tq, Tk, limit)


@pytest.mark.parametrize("mix,rope", [("gate", False), ("sentinel", True)])
def test_compiled_pointwise_parts_equal_eager(mix, rope):
    """train.compile's copy head: its layout/RoPE and per-token combination run as compiled graphs
    (dynamo counts them) and give eager's terms and gradients."""
    from torch._dynamo.utils import counters

    eager, compiled = (make_head(mix, "next", 2, rope=rope) for _ in range(2))
    before = counters["stats"]["unique_graphs"]
    assert compiled.compile_pointwise(torch.device("cpu"))
    h, ids, labels, logits = inputs(seed=7)
    outs = []
    for head in (eager, compiled):
        x = h.clone().requires_grad_(True)
        terms = head(x, ids, labels)
        vp.mixed_nll(logits, labels, terms, mix).nll.sum().backward()
        outs.append((terms, x.grad, [p.grad for p in head.parameters()]))
    assert counters["stats"]["unique_graphs"] >= before + 2
    (te, he, pe), (tc, hc, pc) = outs
    for a, b in zip(te, tc):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hc, he, rtol=1e-5, atol=1e-6)
    for a, b in zip(pe, pc):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
