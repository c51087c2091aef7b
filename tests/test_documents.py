"""Document masking (data.document_mask): a packed row of documents gives each document the
per-token nll and the gradients it gets alone, at tp = 1 and 2, with and without sequence
parallelism, for every mix and paste mode, copy off, every backbone, the chunked copy path and the
chunked loss; the flex paths (attention and the copy LSE) and decoding (packed prompts prefilled in
chunks, then continued) agree; pipeline stages carry the positions (pp = 2 trains as pp = 1 does);
bad positions and data without end-of-document ids get one line."""

import json

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks
from tests.test_model import VARIANTS

# the variants of the whole-model test (every mix and paste mode, copy off, gpt2, qwen3, the chunked copy
# path at chunk 5 or 7 of 24, padded and untied vocabularies, the chunked loss)
DOC_VARIANTS = {name: VARIANTS[name] for name in (
    "copy-off-padded-untied", "gate-next-2heads-rope", "gate-self", "joint-next", "joint-self-padded-untied",
    "sentinel-next-2heads", "sentinel-self", "gpt2-gate-next", "gpt2-mha-copy-off-untied", "joint-next+chunked-loss",
    "qwen3-gate-next")}
LENGTHS = (8, 6, 10)  # three documents in one row of 24 (each even: alone, each divides over tp = 2 under sp)


def packed_row(vocab: int):
    """(ids (2, 24), position_ids (2, 24), the documents' ids (2 rows x 3)): each document a span
    then its repeat; the third document repeats the first's span too, so a copy head that saw
    across documents would find matches there."""
    g = torch.Generator().manual_seed(5)
    rows, docs = [], []
    for _ in range(2):
        first = torch.randint(3, vocab, (LENGTHS[0] // 2,), generator=g)
        second = torch.randint(3, vocab, (LENGTHS[1] // 2,), generator=g)
        third = torch.cat([first[:3], torch.randint(3, vocab, (2,), generator=g)])
        row_docs = [torch.cat([first, first]), torch.cat([second, second]), torch.cat([third, third])]
        docs.append(row_docs)
        rows.append(torch.cat(row_docs))
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).expand(2, -1).contiguous()
    return torch.stack(rows), positions, docs


def _labels(ids):
    """The next id, -100 at each document's last token (its label is the next document's first:
    no alone counterpart)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    for end in torch.tensor(LENGTHS).cumsum(0) - 1:
        labels[:, end] = -100
    return labels


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_and_alone(model, ids, positions, docs):
    """(packed nll (2, 24), alone nll, packed grads, alone grads summed over documents), the loss
    weighted per token so that every position's gradient counts apart."""
    weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)
    model.zero_grad()
    out = model(ids, _labels(ids), positions)
    (out.nll * weights).sum().backward()
    packed_grads = _grads(model)
    model.zero_grad()
    alone, start = [], 0
    for i, n in enumerate(LENGTHS):
        doc = torch.stack([docs[0][i], docs[1][i]])
        nll = model(doc).nll
        (nll * weights[:, start : start + n]).sum().backward()
        alone.append(nll.detach())
        start += n
    return out.nll.detach(), torch.cat(alone, 1), packed_grads, _grads(model)


def _decoding(model, ids, positions, docs):
    """Packed prompts against their documents alone: the distributions, `score` in blocks of 5,
    a prefill in three chunks, and three tokens continued after it without positions."""
    lp = model.next_token_logprobs(ids, positions)
    alone = torch.cat([model.next_token_logprobs(torch.stack([docs[0][i], docs[1][i]])) for i in range(3)], 1)
    targets = ids.roll(-1, 1)
    score = model.score(ids, targets, position_ids=positions, rows=5)[0]
    state, chunks = model.new_decode_state(ids.shape[0], ids.shape[1] + 3), []
    for a, b in ((0, 5), (5, 13), (13, 24)):
        chunks.append(model.next_token_logprobs(ids[:, a:b], positions[:, a:b], state))
    more = torch.randint(3, 100, (2, 3), generator=torch.Generator().manual_seed(1))
    continued = model.next_token_logprobs(more, state=state)
    last = torch.stack([docs[0][2], docs[1][2]])
    return {"logprobs": (lp, alone), "score": (score, lp.gather(-1, targets[..., None]).squeeze(-1)),
            "chunks": (torch.cat(chunks, 1), lp),
            "continued": (continued, model.next_token_logprobs(torch.cat([last, more], 1))[:, -3:])}


def _documents_worker(tp, sp):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model

    init_distributed(tp)
    results = {}
    for name, overrides in DOC_VARIANTS.items():
        if sp and name.startswith("gpt2-mha"):
            continue
        cfg = load_config("tiny", overrides + [f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}"])
        model = build_model(cfg)
        ids, positions, docs = packed_row(cfg.model.vocab_size)
        results[name] = {"train": _packed_and_alone(model, ids, positions, docs)}
        if name == "joint-next" and not sp:
            results[name]["plain"] = model(ids, _labels(ids)).nll.detach()
            results["bad"] = _refusals(model, ids, positions)
        if not sp:
            results[name]["decode"] = _decoding(model.eval(), ids, positions, docs)
    return results


def _refusals(model, ids, positions) -> list[str]:
    """The one-line messages for position_ids that cannot be a row's documents."""
    from cplm_dist.errors import UsageError

    messages = []
    for bad in (positions[:, :-1], positions.float(), positions + 1):
        try:
            model(ids, None, bad)
            messages.append("accepted")
        except UsageError as e:
            messages.append(str(e))
    state = model.new_decode_state(ids.shape[0], 4)  # decoding (a later chunk) may start anywhere
    model.eval().next_token_logprobs(ids[:, :4], positions[:, :4] + 7, state)
    model.train()
    return messages


@pytest.fixture(scope="module")
def document_runs():
    return {layout: run_ranks(_documents_worker, layout[0], args=layout, timeout=300)
            for layout in ((1, False), (2, False), (2, True))}


def _document_positions():
    """Positions whose prediction has an alone counterpart (all but each document's last)."""
    ends = set((torch.tensor(LENGTHS).cumsum(0) - 1).tolist())
    return [t for t in range(sum(LENGTHS)) if t not in ends]


@pytest.mark.parametrize("layout", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"])
@pytest.mark.parametrize("variant", sorted(DOC_VARIANTS))
def test_a_packed_row_gives_each_document_what_it_gets_alone(document_runs, layout, variant):
    for res in document_runs[layout]:
        if variant not in res:
            continue
        packed, alone, packed_grads, alone_grads = res[variant]["train"]
        keep = _document_positions()
        assert torch.allclose(packed[:, keep], alone[:, keep], atol=1e-5, rtol=0), (packed - alone).abs().max()
        assert packed_grads.keys() == alone_grads.keys() and packed_grads
        for pname, g in packed_grads.items():
            assert torch.allclose(g, alone_grads[pname], atol=1e-5, rtol=1e-5), (pname, (g - alone_grads[pname]).abs().max())


@pytest.mark.parametrize("layout", [(1, False), (2, False)], ids=["tp1", "tp2"])
@pytest.mark.parametrize("variant", ["gate-next-2heads-rope", "joint-self-padded-untied", "sentinel-next-2heads",
                                     "gpt2-gate-next", "qwen3-gate-next"])
def test_packed_prompts_decode_as_their_documents_do(document_runs, layout, variant):
    """The distributions of a packed prompt, its scores, a prefill in chunks, and decoding on
    after it (without positions: the last document continues) equal each document's alone."""
    for res in document_runs[layout]:
        for what, (got, want) in res[variant]["decode"].items():
            if what == "logprobs":
                keep = _document_positions()
                got, want = got[:, keep], want[:, keep]
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (what, (got - want).abs().max())


def test_without_the_mask_the_documents_see_each_other(document_runs):
    """The control: the same row with one document a row (position_ids=None) differs from the
    alone documents after the first, so the equalities above are the mask's doing."""
    res = document_runs[(1, False)][0]["joint-next"]
    _, alone, _, _ = res["train"]
    later = [t for t in _document_positions() if t >= LENGTHS[0]]
    assert (res["plain"][:, later] - alone[:, later]).abs().max() > 1e-3


def _mixed_documents(B: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, document index) (B, T) of rows cut into documents at random places."""
    from cplm_dist.model.documents import document_index

    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, T, generator=g) < 0.02
    starts[:, 0] = True
    index = torch.cumsum(starts.long(), 1)
    first = torch.stack([torch.searchsorted(index[b], index[b], right=False) for b in range(B)])  # each document's first position
    positions = torch.arange(T).expand(B, T) - first
    return positions, document_index(positions)


@pytest.mark.parametrize("paste", ["next", "self"])
def test_every_copy_lse_path_keeps_to_the_documents(paste):
    """dense, chunked (forward and backward) and FlexAttention's kernel (its unfused CPU reference,
    forward) give the same (A, M) under document masking, at an offset too (a sequence-parallel
    rank's rows); a row whose document has no candidate yet gets -inf."""
    from cplm_dist.model.copy_lse import chunked_copy_lse, dense_copy_lse, flex_copy_lse

    B, H, T, d, shift = 2, 2, 300, 16, -1 if paste == "next" else 0
    _, docs = _mixed_documents(B, T)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(B, H, T, d, generator=g), torch.randn(B, H, T, d, generator=g)
    ids = torch.randint(0, 7, (B, T), generator=g)
    src = ids if paste == "self" else torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], 1)
    labels = ids.roll(-1, 1)
    for offset in (0, 140):
        rows = slice(offset, offset + 160)
        qr, lr = q[:, :, rows].clone().requires_grad_(), labels[:, rows]
        kr = k.clone().requires_grad_()
        dense = dense_copy_lse(qr, kr, src, lr, shift, offset, docs)
        chunked = chunked_copy_lse(qr, kr, src, lr, shift, 37, offset, docs)
        flex = flex_copy_lse(q[:, :, rows], k, src, lr, shift, offset, compiled=False, docs=docs)
        for got in (chunked, flex):
            for a, b in zip(got, dense):
                assert torch.equal(torch.isinf(a), torch.isinf(b))
                fin = torch.isfinite(b)
                assert torch.allclose(a[fin], b[fin], atol=1e-5)
        grads = []
        for a, m in (dense, chunked):
            w = torch.linspace(0.1, 1, a.numel()).view_as(a)
            loss = (a.nan_to_num(0, 0, 0) * w).sum() + (m.nan_to_num(0, 0, 0) * w.flip(-1)).sum()
            grads.append(torch.autograd.grad(loss, [qr, kr]))
        for a, b in zip(*grads):
            assert torch.allclose(a, b, atol=1e-5)
    starts = (docs[:, 1:] != docs[:, :-1]).nonzero()
    b, t = starts[0, 0], starts[0, 1] + 1  # a document's first position: no earlier candidate in it
    if paste == "next":
        assert dense_copy_lse(q, k, src, None, shift, 0, docs)[0][b, :, t].isneginf().all()


def _dense_attention(q, k, v, visible):
    """The reference: softmax(q k^T / sqrt(d)) v over the keys `visible` (.., Tq, Tk) allows, heads sharing kv repeated."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


def test_the_core_attention_kernels_agree_with_a_dense_reference():
    """The kernels a model is built with (cplm_dist.model.core_attention), each through its own
    masks: SDPA's (CPU) and FlexAttention's (CUDA's document attention under its BlockMask, run by
    FlexAttention's eager reference here), grouped heads, for causal attention, a KV cache's
    continuation (queries at offset 200 of 260 keys) and packed documents, whole and continued."""
    from cplm_dist.model.core_attention import FlexAttention, SDPAttention

    B, T, offset = 2, 260, 200
    _, docs = _mixed_documents(B, T, seed=4)
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(B, 4, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same_doc = docs[:, None, :, None] == docs[:, None, None, :]  # (B, 1, T, T)
    for kernel in (SDPAttention(), FlexAttention()):
        for name, d, start, visible in (("causal", None, 0, causal), ("continued", None, offset, causal),
                                        ("documents", docs, 0, causal & same_doc),
                                        ("documents continued", docs, offset, causal & same_doc)):
            masks = kernel.masks(d, start, T - start, q.device)
            got = kernel(q[:, :, start:], k, v, masks)
            want = _dense_attention(q[:, :, start:], k, v, visible[..., start:, :])
            assert torch.allclose(got, want, atol=1e-5), (type(kernel).__name__, name, (got - want).abs().max())


# --- the data and training ------------------------------------------------------------------------


def _loader_worker(cfg_args):
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.distributed import init_distributed

    init_distributed(1)
    assert cfg_args[0] == "--config"
    cfg = load_config(cfg_args[1], cfg_args[2:])
    data = build_datasets(cfg, (64, 0, 0))
    batch = next(iter(ResumableLoader(data.train, 16)))
    return batch, data.tokenizer.eod


def test_the_loader_restarts_positions_after_each_end_of_document(small_data, tmp_path):
    from tests.test_train import argv

    batch, eod = run_ranks(_loader_worker, 1, args=(argv(small_data, tmp_path / "x", "data.document_mask=true"),))[0]
    ids, positions = batch["input_ids"], batch["position_ids"]
    assert positions.shape == ids.shape and (positions[:, 0] == 0).all()
    after_eod = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids[:, :-1] == eod], 1)
    assert after_eod.any(), "the rows must cross documents"
    assert torch.equal(positions == 0, after_eod | (torch.arange(ids.shape[1]) == 0))
    steps = positions[:, 1:] - positions[:, :-1]
    assert ((steps == 1) | (positions[:, 1:] == 0)).all()


def test_position_ids_that_are_no_document_layout_get_one_line(document_runs):
    shape, dtype, start = document_runs[(1, False)][0]["bad"]
    assert "position_ids of shape (2, 23) for input_ids of shape (2, 24)" in shape
    assert "integer positions" in dtype
    assert "must start at 0" in start
    assert all("\n" not in m for m in (shape, dtype, start))


def _pp_doc_args(small_data, out, micro, *extra):
    from tests.test_train import argv

    return argv(small_data, out, "model.num_layers=4", "train.train_steps=4", "train.global_batch_size=4",
                f"train.micro_batch_size={micro}", "train.eval_interval=4", f"train.eval_batches={4 // micro}",
                "data.document_mask=true", *extra)


def test_pipeline_stages_carry_the_positions(small_data, tmp_path):
    """pp = 2 (1F1B, four micro-batches a step, the positions sent from stage to stage with the
    ids and labels) with tp = 2 stages trains as one rank does under document masking, losses and
    validation; the qwen3 backbone (its qk-norm gradients summed over tp inside a stage; llama's
    pipelines are test_train's)."""
    from tests.test_train import losses, read_metrics, train

    one, pp2 = tmp_path / "one", tmp_path / "pp2"
    model = ["model.arch=qwen3", "model.head_dim=24"]
    assert train(1, _pp_doc_args(small_data, one, 4, "train.zero_stage=0", *model)) == [0]
    assert train(4, _pp_doc_args(small_data, pp2, 1, "parallel.pp=2", "parallel.tp=2", "train.zero_stage=1", *model)) == [0] * 4
    got, want = losses(pp2), losses(one)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert abs(got[step] - want[step]) < 1e-4, (step, got[step], want[step])
    valid = [read_metrics(d / "logs" / "metrics.jsonl", "valid")[4]["loss"] for d in (pp2, one)]
    assert abs(valid[0] - valid[1]) < 1e-4, valid
    config = json.loads((one / "checkpoints" / "step-00000004" / "config.json").read_text()) if (
        one / "checkpoints" / "step-00000004" / "config.json").exists() else None
    assert config is None or config["data"]["document_mask"] is True


def test_document_masking_refuses_data_made_without_end_of_document_ids(small_data, tmp_path):
    """--no-eod data has no boundary to find: one line naming the dataset and the fix, exit 2,
    nothing written."""
    import subprocess
    import sys

    from cplm_dist.data.indexed_data import write_indexed_dataset
    from cplm_dist.data.sources import iter_documents
    from cplm_dist.data.tokenizer import load_tokenizer
    from tests.test_train import argv

    prefix = str(tmp_path / "noeod")
    write_indexed_dataset(iter_documents([small_data.raw["copy"]]), load_tokenizer(small_data.tokenizer), prefix,
                          progress=False, append_eod=False)
    args = [a if not a.startswith("data.blend=") else f"data.blend=[{{path: {prefix}}}]"
            for a in argv(small_data, tmp_path / "out", "data.document_mask=true")]
    proc = subprocess.run([sys.executable, "-m", "cplm_dist.train", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "data.document_mask=true" in line and prefix in line and "--no-eod" in line
    assert not (tmp_path / "out").exists()
