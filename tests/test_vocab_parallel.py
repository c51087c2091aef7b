"""mixed_nll against the dense float64 mixture (values and gradients), gradcheck, the closed-form
logits gradient, and tp = 2 and 4 on gloo against one process."""

import math

import pytest
import torch
import torch.distributed as dist

import cplm_dist.model.loss as vp
from cplm_dist.model.parallel.sharding import ShardSpec, gather_full, take_shard
from tests import reference
from tests.spawn import run_ranks

MIXES = ("gate", "joint", "sentinel", "joint_gate")
N, V = 14, 64


def make_inputs(seed=0, dtype=torch.float64, n=N, v=V):
    """Rows with and without candidates, matches and ignored labels."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=dtype) * 2
    copy_all = torch.randn(n, generator=g, dtype=dtype) + 1.0
    copy_match = copy_all - torch.rand(n, generator=g, dtype=dtype) * 3  # a subset of the candidates
    gate = torch.randn(n, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    copy_all[0] = copy_match[0] = -math.inf  # no candidate (t = 0 in `next` mode)
    copy_match[[2, 5]] = -math.inf  # candidates, none pasting the label
    labels[[3, 9]] = vp.IGNORE_INDEX
    copy_match[9] = -math.inf
    return logits, copy_all, copy_match, gate, labels


def nll(z, a, m, g, labels, mix, tp_group=None, **kw):
    """mixed_nll's loss from flat per-row tensors."""
    return vp.mixed_nll(z, labels, vp.CopyTerms(a, m, g), mix, tp_group, **kw).nll


def grads_of(fn, tensors, weights):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    (out * weights).sum().backward()
    return out.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]


@pytest.mark.parametrize("mix", MIXES)
def test_matches_dense_reference_values_and_gradients(mix):
    logits, copy_all, copy_match, gate, labels = make_inputs()
    weights = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, got_grads = grads_of(lambda z, a, m, g: nll(z, a, m, g, labels, mix), (logits, copy_all, copy_match, gate), weights)
    ref, ref_grads = grads_of(lambda z, a, m, g: reference.mixture_nll(z, a, m, g, labels, mix), (logits, copy_all, copy_match, gate), weights)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert (got[[3, 9]] == 0).all()
    for name, a, b in zip(("logits", "copy_all", "copy_match", "gate"), got_grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d nll / d {name}")
    assert (got_grads[0][[3, 9]] == 0).all(), "ignored rows must not reach the logits"


@pytest.mark.parametrize("mix", MIXES)
def test_gradcheck(mix):
    logits, copy_all, copy_match, gate, labels = make_inputs(n=10, v=9)
    inputs = tuple(t.requires_grad_(True) for t in (logits, copy_all, copy_match, gate))
    assert torch.autograd.gradcheck(lambda z, a, m, g: nll(z, a, m, g, labels, mix), inputs)


@pytest.mark.parametrize("mix", ["gate", "sentinel", "joint"])
def test_logits_gradient_is_the_closed_form(mix):
    logits, copy_all, copy_match, gate, labels = make_inputs(seed=3)
    logits.requires_grad_(True)
    nll(logits, copy_all, copy_match, gate, labels, mix).sum().backward()
    z = logits.detach()
    softmax = torch.softmax(z, -1)
    keep = labels != vp.IGNORE_INDEX
    y = labels.clamp(min=0)
    onehot = torch.nn.functional.one_hot(y, V).double()
    loss = nll(z, copy_all, copy_match, gate, labels, mix)
    lm_log_p = z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, -1)
    if mix == "joint":
        log_z = torch.logaddexp(torch.logsumexp(z, -1), copy_all)
        z_y = z.gather(1, y[:, None]).squeeze(1)
        expected = torch.exp(z - log_z[:, None]) - onehot * torch.exp(z_y - torch.logaddexp(z_y, copy_match))[:, None]
    else:
        if mix == "gate":
            log_g = torch.where(torch.isfinite(copy_all), torch.nn.functional.logsigmoid(gate), 0.0)
        else:
            log_g = gate - torch.logaddexp(gate, copy_all)
        r = torch.exp(log_g + lm_log_p + loss)  # posterior weight of the LM component
        expected = r[:, None] * (softmax - onehot)
    expected[~keep] = 0
    torch.testing.assert_close(logits.grad, expected, rtol=1e-10, atol=1e-12)


def test_inplace_mode_equals_copying_mode_and_bf16_is_close():
    logits, copy_all, copy_match, gate, labels = [t.float() if t.is_floating_point() else t for t in make_inputs(seed=4)]
    weights = torch.rand(N)
    ref, ref_grads = grads_of(lambda z: nll(z, copy_all, copy_match, gate, labels, "gate"), (logits,), weights)

    def inplace(z):
        return nll(z * 1.0, copy_all, copy_match, gate, labels, "gate", inplace=True)

    got, got_grads = grads_of(inplace, (logits,), weights)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(got_grads[0], ref_grads[0], rtol=0, atol=0)
    low, _ = grads_of(lambda z: nll(z, copy_all, copy_match, gate, labels, "gate"), (logits.bfloat16(),), weights)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref, rtol=0.02, atol=0.05)


def test_full_distribution_pieces_without_copy_are_log_softmax():
    z = torch.randn(3, 5, 40)
    log_p, copy_part = vp.mixed_log_probs(z)
    torch.testing.assert_close(log_p, torch.log_softmax(z, -1))
    assert copy_part is None


# --- tensor parallel: tp = 2 and 4 against one process ------------------------------------------


def _tp_worker(tp):
    from cplm_dist.distributed import init_distributed

    dims = init_distributed(tp)
    spec = ShardSpec(dim=1)
    results = {}
    for mix in MIXES:
        full, copy_all, copy_match, gate, labels = make_inputs(seed=7, dtype=torch.float32)
        shard = take_shard(full, spec, dims.tp_rank, tp).clone().requires_grad_(True)
        a, m, g = (t.clone().requires_grad_(True) for t in (copy_all, copy_match, gate))
        loss = nll(shard, a, m, g, labels, mix, dims.tp_group)
        (loss * torch.linspace(0.5, 1.5, N)).sum().backward()
        results[mix] = {
            "nll": loss.detach(),
            "d_logits": gather_full(shard.grad, spec, dims.tp_group),
            "d_copy": torch.stack([t.grad if t.grad is not None else torch.zeros_like(t) for t in (a, m, g)]),
        }
    # The full distribution of a mixture, shard by shard, then gathered.
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(9))
    copy_w = torch.softmax(torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(10)), -1)
    src = torch.tensor([[5, V - 1, 17], [40, 40, 2]])
    shard = take_shard(logits, ShardSpec(dim=2), dims.tp_rank, tp)
    copy_lp = vp.scatter_copy_log_probs(copy_w, src, V // tp, dims.tp_group)
    lp, _ = vp.mixed_log_probs(shard, copy_lp, vp.CopyTerms(torch.zeros(2, 3), None, torch.zeros(2, 3)), "gate",
                               dims.tp_group)
    results["dist"] = vp.gather_vocab(lp, dims.tp_group)
    assert dist.get_world_size(dims.tp_group) == tp
    results["chunked"] = {mix: _dense_and_chunked_lm_loss(dims, tp, mix) for mix in (None, *MIXES)}
    return results


REAL_V, D = 60, 8  # 4 padded vocabulary rows: at tp = 4 the last shard holds 12 real ids of 16


def _dense_and_chunked_lm_loss(dims, tp, mix):
    """The loss from hidden states through the LM-head shard, both ways (loss.impl dense and
    chunked, blocks of 5 rows over 14), with dL/dh (all-reduced over tp as the model's region
    does), dL/dW (gathered) and dL/d(copy terms)."""
    _, copy_all, copy_match, gate, labels = make_inputs(seed=11, dtype=torch.float32)
    labels = torch.where(labels == vp.IGNORE_INDEX, labels, labels % REAL_V)
    g = torch.Generator().manual_seed(12)
    h_full, w_full = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    w_full[REAL_V:] = 0
    spec = ShardSpec(dim=0)
    v_local = V // tp
    real_local = max(0, min(v_local, REAL_V - dims.tp_rank * v_local))
    out = {}
    for impl in ("dense", "chunked"):
        h = h_full.clone().requires_grad_(True)
        w = take_shard(w_full, spec, dims.tp_rank, tp).clone().requires_grad_(True)
        terms = [t.clone().requires_grad_(True) for t in (copy_all, copy_match, gate)]
        copy = vp.CopyTerms(*terms) if mix else None
        if impl == "dense":
            logits = torch.nn.functional.linear(h, w)
            logits = logits.masked_fill(torch.arange(v_local) >= real_local, float("-inf"))
            loss = vp.mixed_nll(logits, labels, copy, mix or "gate", dims.tp_group).nll
        else:
            z_y, lse = vp.chunked_target_logit_and_lse(h, w, labels, dims.tp_group, real_local=real_local, rows=5)
            loss = vp.mixed_nll_from_lm(z_y, lse, labels, copy, mix or "gate").nll
        (loss * torch.linspace(0.5, 1.5, N)).sum().backward()
        dh = h.grad.clone()
        if impl == "dense" and tp > 1:
            dist.all_reduce(dh, group=dims.tp_group)
        d_copy = torch.stack([t.grad if t.grad is not None else torch.zeros_like(t) for t in terms])
        out[impl] = {"nll": loss.detach(), "dh": dh, "dw": gather_full(w.grad, spec, dims.tp_group), "d_copy": d_copy}
    return out


@pytest.fixture(scope="module")
def tp_results():
    return {tp: run_ranks(_tp_worker, tp, args=(tp,)) for tp in (1, 2, 4)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mix", MIXES)
def test_tp_equals_one_process(tp_results, tp, mix):
    one = tp_results[1][0][mix]
    # the tp=1 run in a process group equals the tp_group=None path
    full, copy_all, copy_match, gate, labels = make_inputs(seed=7, dtype=torch.float32)
    torch.testing.assert_close(one["nll"], nll(full, copy_all, copy_match, gate, labels, mix))
    for rank, res in enumerate(tp_results[tp]):
        r = res[mix]
        torch.testing.assert_close(r["nll"], one["nll"], rtol=1e-6, atol=1e-6, msg=f"nll, rank {rank}")
        torch.testing.assert_close(r["d_logits"], one["d_logits"], rtol=1e-5, atol=1e-7, msg=f"d logits, rank {rank}")
        torch.testing.assert_close(r["d_copy"], one["d_copy"], rtol=1e-5, atol=1e-7, msg=f"d copy, rank {rank}")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_full_distribution_equals_one_process(tp_results, tp):
    one = tp_results[1][0]["dist"]
    torch.testing.assert_close(one.exp().sum(-1), torch.ones(2, 3))
    for res in tp_results[tp]:
        torch.testing.assert_close(res["dist"], one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("mix", [None, *MIXES])
def test_chunked_lm_loss_equals_dense(tp_results, tp, mix):
    """loss.impl=chunked: the same loss and gradients of h, the LM weight and the copy terms as the
    dense path at the same tp (fp32, 1e-6), and as one process; copy off too (mix None)."""
    one = tp_results[1][0]["chunked"][mix]["dense"]
    assert torch.isfinite(one["nll"]).all() and one["dw"][REAL_V:].abs().max() == 0  # padding gets no gradient
    for rank, res in enumerate(tp_results[tp]):
        dense, chunked = res["chunked"][mix]["dense"], res["chunked"][mix]["chunked"]
        for key in ("nll", "dh", "dw", "d_copy"):
            torch.testing.assert_close(chunked[key], dense[key], rtol=1e-6, atol=1e-6, msg=f"{key}, rank {rank}")
            torch.testing.assert_close(chunked[key], one[key], rtol=1e-5, atol=1e-6, msg=f"{key} vs one process, rank {rank}")
