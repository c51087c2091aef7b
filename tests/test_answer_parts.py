"""Where an answer's probability comes from (issue 61): beside accuracy, the evaluation reports
`lm_accuracy` (the LM head alone), `copy_pointer_accuracy` (the copy head's most probable candidate
pastes the answer) and `copy_share` (the mix's weight on the copy side), so that a decay of
retrieval reads as backbone, pointer or gate. Checked on a hand-built model whose copy head points
right by construction (queries and keys the normalised embeddings, the layers passing them through),
under a gate that says no and one that says yes, at tp 1 and 2."""

import random

import pytest
import torch

from cplm_dist.config import load_config
from tests.spawn import run_ranks


def hand_built(tp: int, gate_bias: float):
    from cplm_dist.model import build_model

    cfg = load_config("tiny", ["model.num_layers=1", "copy.head_dim=128", "copy.mix=gate", "train.eval_tasks=[induction]",
                               "train.eval_task_samples=4", "data.seq_length=64", f"parallel.tp={tp}"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attention.proj.weight", "mlp.fc2.weight")):
                p.zero_()  # the layer adds nothing: the final states are the normalised embeddings
        for proj in (model.copy_head.q, model.copy_head.k):
            proj.weight.copy_(4.0 * torch.eye(128))  # a token's query meets its own earlier keys most
        model.copy_head.gate.weight.zero_()
        model.copy_head.gate.bias.fill_(gate_bias)
    return cfg, model


def _worker(tp):
    from cplm_dist.distributed import init_distributed
    from cplm_dist.evaluation.in_loop import in_loop_eval
    from cplm_dist.evaluation.tasks import Sample, score_positions

    dims = init_distributed(tp)
    r = random.Random(0)
    spans = [r.sample(range(4, 512), 12) for _ in range(4)]  # distinct ids: one earlier occurrence each
    samples = [Sample(s + s, scored=list(range(12, 23))) for s in spans]
    out = {}
    for gate, bias in (("no", 30.0), ("yes", -30.0)):  # the gate logit weighs the LM side
        cfg, model = hand_built(tp, bias)
        out[gate] = score_positions(model, samples)
        out[f"in_loop_{gate}"] = in_loop_eval(model, cfg, dims)["tasks"]["induction"]
    off = load_config("tiny", ["copy.enabled=false", f"parallel.tp={tp}"])
    from cplm_dist.model import build_model
    out["off"] = score_positions(build_model(off).eval(), samples)
    return out


@pytest.fixture(scope="module")
def scored():
    return {tp: run_ranks(_worker, tp, args=(tp,))[0] for tp in (1, 2)}


def test_a_pointer_that_is_right_under_a_gate_that_says_no(scored):
    for tp, out in scored.items():
        no, yes = out["no"], out["yes"]
        assert no["copy_pointer_accuracy"] == 1.0 and no["copy_share"] < 1e-9, (tp, no)
        assert no["accuracy"] == no["lm_accuracy"] < 0.5, (tp, no)  # the answer comes from the LM alone
        assert yes["copy_pointer_accuracy"] == 1.0 and yes["copy_share"] > 1 - 1e-9 and yes["accuracy"] == 1.0, (tp, yes)
        assert yes["lm_accuracy"] == no["lm_accuracy"]  # the gate does not touch the LM head
        assert out["off"]["copy_pointer_accuracy"] == out["off"]["copy_share"] == 0.0
        for gate in ("no", "yes"):  # the in-loop suite (metrics.jsonl's eval_tasks) reports the same fields
            for row in out[f"in_loop_{gate}"].values():
                assert row["copy_pointer_accuracy"] > 0.9 and (row["copy_share"] < 1e-6) == (gate == "no"), row
    for gate in ("no", "yes", "off"):  # tp 2 reads what the single process reads
        for key, value in scored[1][gate].items():
            assert scored[2][gate][key] == pytest.approx(value, abs=1e-6), (gate, key)
