"""A long run surviving its job chain (docs/reliability.md): the Slurm scripts count planned and
crash requeues apart; a reshape's conversion waits outside the collective timeout and within its
own; checkpoints kept by keep_every and before a WSD decay; the async-save memory check reads the
job's cgroup; tools/chaos.py's weight comparison reads a pipeline checkpoint's layer files."""

from cplm_dist.checkpoint.pruning import decay_start, tags_to_delete
from cplm_dist.config import load_config
from tests.test_train import argv, train

# --- pruning -----------------------------------------------------------------------------------------


def test_pruning_keeps_the_last_n_every_kth_and_the_one_before_a_wsd_decay():
    tags = [f"step-{s:08d}" for s in (100, 200, 300, 400, 500, 600)]
    steps = lambda ts: [int(t[5:]) for t in ts]  # noqa: E731
    assert steps(tags_to_delete(tags, tags[-1], keep_last=2)) == [100, 200, 300, 400]
    assert steps(tags_to_delete(tags, tags[-1], keep_last=1, keep_every=200)) == [100, 300, 500]
    assert steps(tags_to_delete(tags, tags[-1], keep_last=1, before_decay=450)) == [100, 200, 300, 500]
    assert steps(tags_to_delete(tags[:3], tags[2], keep_last=1, before_decay=450)) == [100, 200]  # before it: the newest
    wsd = load_config("tiny", ["optim.schedule=wsd", "train.train_steps=1000", "optim.decay_fraction=0.2"])
    assert decay_start(wsd) == 800 and decay_start(load_config("tiny", ["optim.schedule=cosine"])) is None


def test_a_run_keeps_every_kth_checkpoint_and_the_last_before_its_decay(small_data, tmp_path):
    """6 steps saved every step with keep_last=1, keep_every=4 and a WSD decay from step 3 on."""
    out = tmp_path / "run"
    args = argv(small_data, out, "train.train_steps=6", "train.save_interval=1", "train.keep_last=1",
                "train.keep_every=4", "optim.schedule=wsd", "optim.decay_fraction=0.5")
    assert train(1, args) == [0]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [
        "step-00000003", "step-00000004", "step-00000006"]
