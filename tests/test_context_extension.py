"""Context extension: a new run starts from one of our checkpoints (`model.init_from`, weights
only, any tp) at a longer data.seq_length / model.max_seq_len with model.rope_scaling; the
weights arrive exactly, the scaled positions are the ones asked for, the run trains at the new
length; what cannot work is one line (exit 2). The HF side (export and import of scaled RoPE) is
in tests/test_hf.py."""

import json
import math
from pathlib import Path

import pytest
import torch

from cplm_dist.config import ConfigError, load_config, to_dict
from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks
from tests.test_train import argv, run_cli, train

LONGER = ("model.max_seq_len=256", "data.seq_length=128", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2")
FROZEN = ("optim.lr=1e-30", "optim.min_lr=0", "optim.warmup_steps=0", "optim.weight_decay=0")  # updates below fp32's ulp


@pytest.fixture(scope="module")
def extended(small_data, trained, tmp_path_factory):
    """The shared 6-step tp = 1 run (max_seq_len 128, seq_length 64) continued as a new tp = 2 run
    at seq_length 128, max_seq_len 256, linear RoPE scaling x2: 2 steps with a negligible lr, so
    its checkpoint still holds exactly the weights it started from."""
    out = tmp_path_factory.mktemp("extended") / "run"
    assert train(2, argv(small_data, out, "train.train_steps=2", "parallel.tp=2", *LONGER, *FROZEN,
                         f"model.init_from={trained}")) == [0, 0]
    return out


def _full_weights_worker(paths):
    from cplm_dist.checkpoint import load_model
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model.parallel.sharding import full_state_dict

    init_distributed(1)
    out = []
    for path in paths:
        model, cfg, info = load_model(path)
        out.append({"full": full_state_dict([model.state_dict()], model), "cfg": cfg, "step": info["step"]})
    return out


def test_a_new_run_from_our_checkpoint_gets_its_weights_exactly_and_trains_longer(trained, extended):
    """init_from names the run directory: its newest step (6, tp = 1) starts a tp = 2 run at
    step 0 with a fresh data position; every weight, the copy head's too, is bit-equal."""
    log = read_metrics(extended / "logs" / "metrics.jsonl")
    assert sorted(log) == [1, 2] and all(math.isfinite(r["loss"]) for r in log.values())
    assert log[2]["consumed_tokens"] == 2 * 16 * 128  # from sample 0, at the new length
    source, new = run_ranks(_full_weights_worker, 1, args=([trained, extended],))[0]
    assert source["step"] == 6 and new["step"] == 2
    assert sorted(new["full"]) == sorted(source["full"]) and any(k.startswith("copy_head.") for k in new["full"])
    for name, tensor in source["full"].items():
        assert torch.equal(new["full"][name], tensor), name
    m = new["cfg"].model
    assert (m.max_seq_len, new["cfg"].data.seq_length, m.rope_scaling.type, m.rope_scaling.factor) == (256, 128, "linear", 2.0)
    manifest = json.loads((extended / "checkpoints" / "step-00000002" / "complete.json").read_text())
    assert manifest["layout"]["tp"] == 2 and manifest["config"]["model"]["init_from"] == str(trained)


def test_the_scaled_positions_are_the_asked_ones():
    """linear: positions / factor; ntk: theta x factor^(d/(d-2)); both against a direct computation."""
    from cplm_dist.model.positions import layer_rope

    T, factor = 50, 4.0
    for kind in ("linear", "ntk"):
        m = load_config("tiny", [f"model.rope_scaling={{type: {kind}, factor: {factor}}}", "model.rope_theta=5000"]).model
        d = m.head_dim
        theta = 5000 * factor ** (d / (d - 2)) if kind == "ntk" else 5000.0
        positions = torch.arange(T, dtype=torch.float64) / (factor if kind == "linear" else 1.0)
        angles = torch.outer(positions, 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = layer_rope(m, T - 10, offset=10)
        torch.testing.assert_close(cos.double(), angles.cos()[10:], rtol=0, atol=1e-5, msg=kind)
        torch.testing.assert_close(sin.double(), angles.sin()[10:], rtol=0, atol=1e-5, msg=kind)
        plain = layer_rope(load_config("tiny", ["model.rope_theta=5000"]).model, T)[0]
        assert (plain - layer_rope(m, T)[0]).abs().max() > 1e-2, kind  # the scaling moved them


def _fake_step(tmp_path, trained, **model):
    """A step directory holding only complete.json, of the shared run with `model` changed: what
    init_from checks before anything starts reads only that."""
    step = tmp_path / "fake" / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    data = json.loads((trained / "checkpoints" / "step-00000006" / "complete.json").read_text())
    data["config"]["model"].update(model)
    (step / "complete.json").write_text(json.dumps(data))
    return step


def test_what_cannot_start_is_one_line(small_data, trained, tmp_path):
    from cplm_dist.checkpoint import CheckpointError
    from cplm_dist.interop.init_from import init_source
    from cplm_dist.errors import UsageError

    base = ["model.vocab_size=512", "model.max_seq_len=128", "data.seq_length=64"]
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("hi")
    with pytest.raises(UsageError, match=r"neither one of our checkpoints .* nor a Hugging Face Llama, Mixtral, GPT-2, Qwen3 or Qwen3-MoE .*: point it at one of those$"):
        init_source(load_config("tiny", [*base, f"model.init_from={tmp_path / 'neither'}"]))
    with pytest.raises(UsageError, match=r": no such directory: give one of our run"):
        init_source(load_config("tiny", [*base, f"model.init_from={tmp_path / 'absent'}"]))
    with pytest.raises(ConfigError, match=r"its model\.num_layers=2 but this run has model\.num_layers=3: set model\.num_layers=2"):
        init_source(load_config("tiny", [*base, "model.num_layers=3", f"model.init_from={trained}"]))
    with pytest.raises(ConfigError, match=r"its copy\.mix=gate but this run has copy\.mix=joint: set copy\.mix=gate"):
        init_source(load_config("tiny", [*base, "copy.mix=joint", f"model.init_from={trained}"]))
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint there"):
        init_source(load_config("tiny", [*base, f"model.init_from={tmp_path / 'empty-run'}"]))
    off = init_source(load_config("tiny", [*base, "copy.enabled=false", f"model.init_from={trained}"]))
    assert off.kind == "checkpoint" and off.path.name == "step-00000006" and "left out" in off.notes[0]
    # pp > 1: refused as it loads, as for a HF Llama
    with pytest.raises(ConfigError, match=r"^model\.init_from with parallel\.pp=2: starting from a HF Llama or a "
                                          r"checkpoint is wired for pp=1 only; drop model\.init_from or train at parallel\.pp=1$"):
        load_config("tiny", [*base, "parallel.pp=2", f"model.init_from={trained}"])


def test_a_gpt2_checkpoint_cannot_stretch_its_learned_positions(small_data, trained, tmp_path):
    """Through cplm-train: one line, exit 2, nothing written."""
    step = _fake_step(tmp_path, trained, arch="gpt2")
    fresh = tmp_path / "fresh"
    proc = run_cli(argv(small_data, fresh, "model.arch=gpt2", "model.max_seq_len=256", f"model.init_from={step}"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: model.init_from={step}: model.arch=gpt2 learns one position embedding a position (a 128-row table), "
        "which cannot stretch to model.max_seq_len=256: keep model.max_seq_len=128 (a longer context needs rotary "
        "positions, model.arch=llama)")
    assert not fresh.exists()


def test_a_plain_resume_cannot_change_the_positions(trained):
    """A resume keeps the saved positions; the message points to a new run with init_from."""
    from cplm_dist.checkpoint import CheckpointError, check_config_change, read_manifest
    from cplm_dist.config import RopeScaling, from_dict

    manifest = read_manifest(trained / "checkpoints" / "step-00000006")
    check_config_change(manifest, from_dict(manifest.config))
    for field, value, shown in (("rope_scaling", RopeScaling("ntk", 2.0), r"rope_scaling None -> \{'type': 'ntk', 'factor': 2\.0\}"),
                                ("max_seq_len", 256, r"max_seq_len 128 -> 256")):
        cfg = from_dict(manifest.config)
        setattr(cfg.model, field, value)
        with pytest.raises(CheckpointError, match=rf"another config \(model\.{shown}\).*a context extension is a new "
                                                  r"run: model\.init_from="):
            check_config_change(manifest, cfg)
    assert to_dict(load_config("tiny"))["model"]["rope_scaling"] is None


def test_a_resume_names_the_field_changed_not_the_head_dim_filled_in_from_it(trained):
    """model.head_dim is filled in from hidden_size / num_heads: a resume that changes the width is
    named by the width (the first field of the line), and a head_dim set to another width by itself."""
    from cplm_dist.checkpoint import CheckpointError, check_config_change, read_manifest
    from cplm_dist.config import from_dict

    manifest = read_manifest(trained / "checkpoints" / "step-00000006")
    saved = manifest.config["model"]
    for field, value in (("hidden_size", saved["hidden_size"] * 2), ("num_heads", saved["num_heads"] * 2),
                         ("head_dim", saved["head_dim"] * 2)):
        cfg = from_dict({**manifest.config, "model": {**{k: v for k, v in saved.items() if k != "head_dim"}, field: value}})
        with pytest.raises(CheckpointError, match=rf"another config \(model\.{field} {saved[field]} -> {value}[,)]"):
            check_config_change(manifest, cfg)
    explicit = from_dict({**manifest.config, "model": {**saved, "head_dim": saved["hidden_size"] // saved["num_heads"]}})
    check_config_change(manifest, explicit)  # the filled-in width written out is the same model


def test_rope_scaling_is_validated_one_line():
    cases = [
        (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=2"],
         r"^model\.rope_scaling\.type='yarn' is not valid: choose one of \['linear', 'ntk'\]$"),
        (["model.rope_scaling.type=linear"], r"^model\.rope_scaling lacks required key 'model\.rope_scaling\.factor'$"),
        (["model.rope_scaling={type: linear, factor: 1}"], r"^model\.rope_scaling\.factor=1\.0 must be > 1 .*model\.rope_scaling=null\)$"),
        (["model.rope_scaling={type: ntk, factor: many}"], r"^model\.rope_scaling\.factor='many' must be a number$"),
        (["model.rope_scaling=linear"], r"^model\.rope_scaling must be a mapping, got 'linear': give its keys, e\.g\. "
                                        r"model\.rope_scaling\.type=\.\.\.$"),
        (["model.arch=gpt2", "model.rope_scaling={type: linear, factor: 2}"],
         r"^model\.rope_scaling is for rotary positions, which model\.arch=gpt2 does not have .*: drop model\.rope_scaling "
         r"or use model\.arch=llama$"),
    ]
    for overrides, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            load_config("tiny", overrides)
    cfg = load_config("tiny", ["model.rope_scaling.type=ntk", "model.rope_scaling.factor=8"])
    assert (cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor) == ("ntk", 8.0)
    assert load_config("tiny", ["model.rope_scaling={type: ntk, factor: 8}", "model.rope_scaling=null"]).model.rope_scaling is None


def test_the_documented_command_parses():
    """docs/training.md's "Context extension" overrides load as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text()
    section = text.split("## Context extension", 1)[1].split("\n## ", 1)[0]
    line = next(x for x in section.splitlines() if "model.rope_scaling.type=" in x and x.startswith("python"))
    overrides = [w for w in line.split() if "=" in w and not w.startswith("model.init_from")]
    cfg = load_config("quickstart", overrides)
    assert cfg.model.rope_scaling is not None and cfg.data.seq_length <= cfg.model.max_seq_len
