"""The per-source figures a run logs for its first step, against the same initial weights re-scored
in one process on each source's samples of that step (the dense reference of the per-source sums:
cplm_dist.training.reduction). Used by the layouts' own tests (dp, cp, pp), on the runs they
already make."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.spawn import run_ranks


def _rescore_worker(args):
    from cplm_dist.config.cli import config_parser, load_from_args
    from cplm_dist.config.curriculum import source_names
    from cplm_dist.data.gpt_data import check_data
    from cplm_dist.data.loader import model_inputs
    from cplm_dist.data.staged_loader import build_train_data
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model.cplm import build_model

    cfg = load_from_args(config_parser("").parse_intermixed_args(args))
    cfg.parallel.tp = cfg.parallel.cp = cfg.parallel.pp = 1  # one process: the whole model, whole rows
    dims = init_distributed(1)
    tokenizer = check_data(cfg)
    _, loader = build_train_data(cfg, dims, tokenizer, 0)
    loader.loaders[0].micro = 1  # one row at a time: the step's global batch is samples [0, global_batch)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    names, sums = source_names(cfg), {}
    with torch.no_grad():
        for _ in range(cfg.train.global_batch_size):
            batch = next(loader)
            out = model(*model_inputs(batch))
            tokens = int((batch["labels"] != -100).sum())
            nll, tokens_so_far = sums.get(names[int(batch["source"][0])], (0.0, 0))
            sums[names[int(batch["source"][0])]] = (nll + float(out.nll.double().sum()), tokens_so_far + tokens)
    return {name: (nll / tokens, tokens) for name, (nll, tokens) in sums.items()}


def assert_first_step_sources_rescored(out_dir: Path, args: list[str], tolerance: float = 1e-6) -> None:
    """Step 1's per-source losses and tokens of the run in out_dir equal the re-scored ones, and
    their token-weighted mean is the step's loss (its micro-batches carry equal tokens)."""
    from cplm_dist.training.run_log import read_metrics

    record = read_metrics(Path(out_dir) / "logs" / "metrics.jsonl")[1]
    want = run_ranks(_rescore_worker, 1, args=(args,))[0]
    got = record["sources"]
    assert sorted(got) == sorted(want) and len(got) == 2, (got, want)
    for name, (loss, tokens) in want.items():
        assert got[name]["tokens"] == tokens, name
        assert got[name]["loss"] == pytest.approx(loss, rel=0, abs=tolerance), name
    weighted = sum(f["loss"] * f["tokens"] for f in got.values()) / sum(f["tokens"] for f in got.values())
    assert weighted == pytest.approx(record["loss"], rel=0, abs=tolerance)
