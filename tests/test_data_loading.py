"""Blended datasets and the resumable loader: weights hit, one seed one order, dp ranks disjoint
with the union of one rank's read, tp ranks identical, exact resume in a fresh process."""

import pytest
import torch

from cplm_dist.config import load_config
from cplm_dist.data.gpt_data import check_data
from cplm_dist.errors import DataError
from tests.spawn import run_ranks

MICRO, STEPS = 2, 6


def data_config(small_data, *extra, weights=(0.3, 0.7)):
    blend = ", ".join(f"{{path: {small_data.prefixes[n]}, weight: {w}}}" for n, w in zip(("code", "copy"), weights))
    return load_config("tiny", [f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{blend}]",
                                "data.seq_length=64", "data.split=90,10,0", "data.num_workers=0", *extra])


def _datasets_worker(cfg, cache_dirs):
    """One rank: blend counts, orders for several seeds / cache dirs, and loader batches."""
    from dataclasses import replace

    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.distributed import init_distributed

    init_distributed(1)
    out = {}
    ds = build_datasets(cfg, (10_000, 100, 0))
    out["blend_counts"] = torch.bincount(torch.as_tensor(ds.train.dataset_index[:10_000]).long(), minlength=2)
    out["valid_len"] = len(ds.valid)
    for i, (seed, cache) in enumerate([(cfg.data.seed, cache_dirs[0]), (cfg.data.seed, cache_dirs[1]), (cfg.data.seed + 1, cache_dirs[0])]):
        c = replace(cfg, data=replace(cfg.data, seed=seed, cache_dir=cache))
        train = build_datasets(c, (2_000, 0, 0)).train
        out[f"order{i}"] = torch.stack([train[j]["tokens"] for j in range(20)])
    # the uninterrupted read, and the loader state after STEPS // 2 batches
    loader = ResumableLoader(ds.train, MICRO * 2, num_workers=2)
    batches = []
    for step in range(STEPS):
        if step == STEPS // 2:
            out["state"] = loader.state_dict()
        batches.append(next(loader))
    out["batches"] = batches
    return out


def _resume_worker(cfg, state):
    """A fresh process: restore the loader state and read the rest."""
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.distributed import init_distributed

    init_distributed(1)
    loader = ResumableLoader(build_datasets(cfg, (10_000, 100, 0)).train, MICRO * 2, num_workers=2)
    loader.load_state_dict(state)
    return [next(loader) for _ in range(STEPS - STEPS // 2)]


def _parallel_worker(cfg, tp):
    """Two ranks at (tp, dp) = (1, 2) or (2, 1): the micro-batches each rank reads."""
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.distributed import init_distributed

    dims = init_distributed(tp)
    train = build_datasets(cfg, (10_000, 100, 0)).train
    loader = ResumableLoader(train, MICRO, dims.dp_rank, dims.dp_size, num_workers=0)
    return {"dp_rank": dims.dp_rank, "batches": [next(loader) for _ in range(STEPS)]}


@pytest.fixture(scope="module")
def single(small_data, tmp_path_factory):
    cfg = data_config(small_data)
    caches = [str(tmp_path_factory.mktemp("cache_a")), str(tmp_path_factory.mktemp("cache_b"))]
    return cfg, run_ranks(_datasets_worker, 1, args=(cfg, caches))[0]


def test_blend_hits_its_weights(single):
    _, out = single
    counts = out["blend_counts"].double() / 10_000
    assert abs(counts[0] - 0.3) < 0.02 and abs(counts[1] - 0.7) < 0.02, counts
    assert out["valid_len"] == 100


def test_one_seed_one_order(single):
    _, out = single
    assert torch.equal(out["order0"], out["order1"]), "same seed, fresh cache: same samples in the same order"
    assert not torch.equal(out["order0"], out["order2"]), "another data seed gives another order"


def test_batches_are_next_token_pairs(single, small_data):
    _, out = single
    batch = out["batches"][0]
    assert batch["input_ids"].shape == (MICRO * 2, 64) and batch["labels"].shape == (MICRO * 2, 64)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["input_ids"].max()) < 512


def test_resume_in_a_fresh_process_continues_exactly(single):
    cfg, out = single
    resumed = run_ranks(_resume_worker, 1, args=(cfg, out["state"]))[0]
    assert out["state"] == {"consumed_samples": MICRO * 2 * (STEPS // 2)}
    for got, want in zip(resumed, out["batches"][STEPS // 2:]):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_dp_ranks_read_disjoint_halves_of_one_ranks_read(single):
    cfg, out = single
    ranks = run_ranks(_parallel_worker, 2, args=(cfg, 1))
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    for step in range(STEPS):
        whole = out["batches"][step]["input_ids"]  # one rank, micro * 2 samples
        assert torch.equal(ranks[0]["batches"][step]["input_ids"], whole[:MICRO])
        assert torch.equal(ranks[1]["batches"][step]["input_ids"], whole[MICRO:])


def test_tp_ranks_read_identical_batches(single):
    cfg, out = single
    ranks = run_ranks(_parallel_worker, 2, args=(cfg, 2))
    assert [r["dp_rank"] for r in ranks] == [0, 0]
    for step in range(STEPS):
        assert torch.equal(ranks[0]["batches"][step]["input_ids"], ranks[1]["batches"][step]["input_ids"])
    # dp = 1: the rank reads the samples in order, as one rank with a larger micro-batch does
    read = torch.cat([b["input_ids"] for b in ranks[0]["batches"]])
    assert torch.equal(read, torch.cat([b["input_ids"] for b in out["batches"]])[: len(read)])


def _rebuilt_worker(cfg, prefix, raw, tokenizer_path):
    """Build datasets, rebuild the dataset in place with fewer documents (preprocess --overwrite),
    build again with the same config and cache: the second read must come from the new files."""
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.indexed_data import write_indexed_dataset
    from cplm_dist.data.sources import iter_documents
    from cplm_dist.data.tokenizer import load_tokenizer
    from cplm_dist.distributed import init_distributed

    init_distributed(1)
    tok = load_tokenizer(tokenizer_path)
    write_indexed_dataset(iter_documents([raw]), tok, prefix, progress=False)
    before = build_datasets(cfg, (500, 0, 0)).train
    first = before[0]["tokens"]
    docs = [d for i, d in enumerate(iter_documents([raw])) if i < 60]
    write_indexed_dataset(iter(docs), tok, prefix, progress=False, overwrite=True)
    after = build_datasets(cfg, (500, 0, 0)).train
    return first, len(after.dataset), [after[i]["tokens"] for i in range(len(after))]


def test_a_dataset_rebuilt_in_place_gets_fresh_indices(small_data, tmp_path):
    prefix = str(tmp_path / "rebuilt")
    cfg = load_config("tiny", [f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{{path: {prefix}}}]",
                               "data.seq_length=64", "data.split=100,0,0", "data.num_workers=0",
                               f"data.cache_dir={tmp_path / 'cache'}"])
    first, documents, samples = run_ranks(_rebuilt_worker, 1, args=(cfg, prefix, small_data.raw["copy"], small_data.tokenizer))[0]
    assert documents == 60 and len(samples) >= 500  # megatron repeats the 60 documents over whole epochs
    assert len(list((tmp_path / "cache").iterdir())) == 2, "one cache directory per dataset contents"

def test_bad_data_configs_are_refused_before_reading(small_data, tmp_path):
    with pytest.raises(DataError, match=r"^data.blend is empty"):
        check_data(load_config("tiny", [f"data.tokenizer={small_data.tokenizer}"]))
    with pytest.raises(DataError, match=r"^data.tokenizer is not set"):
        check_data(load_config("tiny", [f"data.blend=[{{path: {small_data.prefixes['copy']}}}]"]))
    missing = load_config("tiny", [f"data.tokenizer={small_data.tokenizer}", f"data.blend=[{{path: {tmp_path / 'nope'}}}]"])
    with pytest.raises(DataError, match=r"nope\.idx is missing \(rebuild it with tools/preprocess_data.py, or fix data.blend\)"):
        check_data(missing)
    with pytest.raises(DataError, match=r"tokenizer .* has 512 ids but model.vocab_size=500"):
        check_data(data_config(small_data, "model.vocab_size=500"))
    with pytest.raises(DataError, match=r"100 valid samples requested but data.split='100,0,0' gives the valid split no documents"):
        check_data(data_config(small_data, "data.split=100,0,0"), (10, 100, 0))


def test_data_workers_follow_the_slurm_tasks_cpus():
    """Under Slurm a rank's workers are at most its share of the task's CPUs less one (the share
    launch/env.sh gives OpenMP: SLURM_CPUS_PER_TASK over CPLM_TASK_PROCS processes); elsewhere as configured."""
    from cplm_dist.data.loader import worker_count

    assert worker_count(2, {}) == 2 and worker_count(6, {"CPLM_TASK_PROCS": "8"}) == 6
    assert worker_count(2, {"SLURM_CPUS_PER_TASK": "1"}) == 0
    assert worker_count(2, {"SLURM_CPUS_PER_TASK": "2"}) == 1
    assert worker_count(2, {"SLURM_CPUS_PER_TASK": "12"}) == 2
    assert worker_count(4, {"SLURM_CPUS_PER_TASK": "96", "CPLM_TASK_PROCS": "8"}) == 4
    assert worker_count(4, {"SLURM_CPUS_PER_TASK": "16", "CPLM_TASK_PROCS": "8"}) == 1
