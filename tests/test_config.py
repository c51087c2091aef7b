"""Config: shipped files load and have the size their name says; bad configs give one clear line."""

import subprocess
import sys
from pathlib import Path

import pytest

from cplm_dist.config import CONFIG_DIR, Config, ConfigError, load_config
from cplm_dist.model.counting import parameter_count
from cplm_dist.model.loss import padded_vocab_size, vocab_padding_note

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(CONFIG_DIR.rglob("*.yaml"))
SIZES = {"135m": 135e6, "360m": 360e6, "1.7b": 1.7e9, "3b": 3e9, "7b": 7e9, "13b": 13e9, "70b": 70e9}


def test_every_shipped_config_loads():
    assert len(SHIPPED) >= 8
    for path in SHIPPED:
        cfg = load_config(path)
        assert isinstance(cfg, Config)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_shipped_model_size_matches_name(name):
    cfg = load_config(f"cplm-{name}")
    assert cfg.model.name == f"cplm-{name}"
    assert cfg.copy.enabled
    total = parameter_count(cfg)["total"]
    assert abs(total / SIZES[name] - 1) <= 0.10, f"cplm-{name} has {total / 1e9:.3f}B parameters"
    # The copy head is small beside the model it rides on (docs/copy_head.md: negligible cost).
    assert parameter_count(cfg)["copy_head"] / total < 0.002
    baseline = load_config(f"cplm-{name}", ["copy.enabled=false"])
    assert parameter_count(baseline)["copy_head"] == 0


def test_qwen3_config_has_the_released_shapes():
    """configs/models/qwen3-0.6b.yaml is Qwen3-0.6B: 596,049,920 parameters without the copy head
    (transformers' Qwen3ForCausalLM of its config, tied), its q/k-norm weights included."""
    cfg = load_config("qwen3-0.6b", ["copy.enabled=false"])
    assert (cfg.model.arch, cfg.model.head_dim, cfg.model.num_heads * cfg.model.head_dim) == ("qwen3", 128, 2048)
    assert parameter_count(cfg)["total"] == 596_049_920
    assert parameter_count(cfg)["layers"] == 28 * (3 * 1024 * 3072 + 1024 * (2048 + 2 * 1024) + 2048 * 1024 + 2 * 1024 + 2 * 128)


def test_sparse_configs_have_their_shapes_and_the_run_passes_preflight(capsys):
    """qwen3-30b-a3b is Qwen3-30B-A3B: 30,532,122,624 parameters without the copy head (every layer
    128 experts of 768, top-8), 3.35B active a token; deepseek-v3-like-15b keeps DeepSeek-V3's
    recipe (first 3 layers dense, a shared expert, sigmoid scores with the expert bias) at 14.7B.
    The 64-GPU run config passes preflight, which names its experts' layout, and a world its ep
    does not fit is one line (exit 2)."""
    from cplm_dist.model.counting import active_parameters
    from cplm_dist.train.preflight import main

    qwen = load_config("qwen3-30b-a3b", ["copy.enabled=false"])
    assert parameter_count(qwen)["total"] == 30_532_122_624 and 3.3e9 < active_parameters(qwen) < 3.4e9
    assert qwen.model.moe.sparse_layers(48) == list(range(48))
    ds = load_config("deepseek-v3-like-15b")
    e = ds.model.moe
    assert ds.model.name == "deepseek-v3-like-15b" and abs(parameter_count(ds)["total"] / 15e9 - 1) < 0.05
    assert e.sparse_layers(ds.model.num_layers)[0] == 3 and e.shared_ffn_hidden_size == e.ffn_hidden_size
    assert (e.score, e.expert_bias) == ("sigmoid", True)
    run = CONFIG_DIR / "runs" / "qwen3-30b-a3b.yaml"
    assert main(["--world", "64", "--config", str(run)]) == 0
    assert "tp 2 x pp 2 x dp 16 (experts: ep 8 x expert_tp 1 of 128), ZeRO-1" in capsys.readouterr().err
    assert main(["--world", "36", "--config", str(run), "parallel.pp=1", "train.global_batch_size=36"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.ep=8 x expert_tp=1 does not divide the 36 ranks" in err[0], err


def test_overrides_are_typed_and_nested():
    cfg = load_config("tiny", ["model.num_layers=4", "copy.mix=joint", "model.norm_eps=1e-6", "copy.enabled=false"])
    assert cfg.model.num_layers == 4 and cfg.copy.mix == "joint" and cfg.model.norm_eps == 1e-6
    assert cfg.copy.enabled is False


def test_head_dim_is_hidden_over_heads_unless_given():
    """model.head_dim null (every config and checkpoint written before the field): hidden_size /
    num_heads, as it always was; given (Qwen3's 128 beside hidden 1024 / 16 heads): its own, and
    hidden_size need not split over the heads then."""
    from cplm_dist.config import from_dict, to_dict

    tiny = load_config("tiny")
    assert tiny.model.head_dim == tiny.model.hidden_size // tiny.model.num_heads == 16
    saved = to_dict(tiny)
    del saved["model"]["head_dim"]  # a checkpoint's config from before the field
    assert from_dict(saved) == tiny
    wide = load_config("tiny", ["model.head_dim=48", "model.hidden_size=100"])  # 100 / 8 heads is not whole
    assert wide.model.head_dim == 48


def test_base_chain(tmp_path):
    (tmp_path / "run.yaml").write_text("base: tiny\nmodel:\n  num_layers: 3\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == load_config("tiny").model.hidden_size


BAD = [
    (["model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=96", "parallel.tp=4"],
     r"^model\.num_heads=6 is not divisible by parallel\.tp=4"),
    (["model.num_kv_heads=2", "parallel.tp=4"], r"^model\.num_kv_heads=2 is not divisible by parallel\.tp=4"),
    (["model.num_kv_heads=3"], r"^model\.num_kv_heads=3 must divide model\.num_heads=8 \(valid: \[1, 2, 4, 8\]\)"),
    (["model.num_layer=4"], r"^unknown key 'model\.num_layer' \(did you mean 'model\.num_layers'\?\)"),
    (["optimizer.lr=1"], r"^unknown key 'optimizer'"),
    (["copy.mix=average"], r"^copy\.mix='average' is not valid: choose one of \['gate', 'joint', 'sentinel', 'joint_gate'\]"),
    (["copy.paste=prev"], r"^copy\.paste='prev' is not valid: choose one of \['next', 'self'\]"),
    (["model.num_layers=two"], r"^model\.num_layers='two' must be an integer"),
    (["copy.enabled=maybe"], r"^copy\.enabled='maybe' must be true or false"),
    (["model.hidden_size=100"], r"^model\.hidden_size=100 must be divisible by model\.num_heads=8"),
    (["model.head_dim=15"], r"^model\.head_dim=15 must be even for rotary embeddings: use 14 or 16$"),
    (["model.head_dim=0"], r"^model\.head_dim=0 must be a positive integer"),
    (["parallel.tp=0"], r"^parallel\.tp=0 must be a positive integer"),
    (["copy.impl=flash"], r"^copy\.impl='flash' is not valid: choose one of \['auto', 'chunked', 'dense', 'flex'\]"),
    (["copy.chunk_size=0"], r"^copy\.chunk_size=0 must be a positive integer"),
    (["train.reduce_bucket_size=0"], r"^train\.reduce_bucket_size=0 must be a positive number of elements"),
    (["loss.impl=chunked", "train.zero_stage=3"], r"^loss\.impl=chunked with train\.zero_stage=3: .* use loss\.impl=dense"),
    (["loss.chunk_rows=0"], r"^loss\.chunk_rows=0 must be a positive integer"),
    (["optim.impl=apex"], r"^optim\.impl='apex' is not valid: choose one of \['auto', 'fused', 'foreach'\]"),
    (["train.overlap_comm=sometimes"], r"^train\.overlap_comm='sometimes' must be"),
    (["train.grad_accum_dtype=fp16"], r"^train\.grad_accum_dtype='fp16' is not valid: choose one of \['fp32', 'bf16'\]"),
    (["train.precision=fp32", "train.grad_accum_dtype=bf16"],
     r"^train\.grad_accum_dtype=bf16 with train\.precision=fp32: .* drop train\.grad_accum_dtype"),
    (["train.precision=bf16", "train.zero_stage=2", "train.grad_accum_dtype=fp32"],
     r"^train\.grad_accum_dtype=fp32 with train\.precision=bf16 at train\.zero_stage=2: .* use train\.zero_stage=1"),
    (["train.precision=bf16", "train.zero_stage=0", "parallel.tp=2", "optim.clip_grad=1.0"],
     r"^train\.precision=bf16 with train\.zero_stage=0 at parallel\.tp>1 .* use train\.zero_stage=1"),
    (["optim.schedule=wsd", "train.train_steps=100", "optim.decay_fraction=0.5", "optim.warmup_steps=60"],
     r"^optim\.warmup_steps=60 overlaps the WSD decay, which starts at step 50"),
    (["model.num_layers"], r"^override 'model\.num_layers' must look like section\.field=value"),
    # numbers: finite, in range (by class: every float field refuses inf and nan)
    (["optim.lr=.inf"], r"^optim\.lr=inf must be a finite number"),
    (["optim.lr=1e39"], r"^optim\.lr=1e\+39 must be a finite number \(within float32's range"),
    (["copy.gate_bias_init=.nan"], r"^copy\.gate_bias_init=nan must be a finite number"),
    (["model.rope_theta=-.inf"], r"^model\.rope_theta=-inf must be a finite number"),
    (["optim.beta1=1.0"], r"^optim\.beta1=1\.0 must be within \[0, 1\)"),
    (["optim.beta2=-0.1"], r"^optim\.beta2=-0\.1 must be within \[0, 1\)"),
    (["optim.eps=0"], r"^optim\.eps=0\.0 must be > 0"),
    (["model.init_std=0"], r"^model\.init_std=0\.0 must be > 0"),
    (["train.collective_timeout_minutes=0"], r"^train\.collective_timeout_minutes=0\.0 must be > 0"),
    (["train.out_dir=''"], r"^train\.out_dir is empty"),
]


@pytest.mark.parametrize("overrides,pattern", BAD, ids=[b[0][-1] for b in BAD])
def test_bad_config_one_line_error(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config("tiny", overrides)
    assert "\n" not in str(info.value)


def test_yaml_semantics_are_not_surprising(tmp_path):
    """A key given twice is refused (YAML keeps the last silently); an empty section in a child
    config changes nothing; a file that is not UTF-8 is one line."""
    (tmp_path / "twice.yaml").write_text("base: tiny\nmodel:\n  num_layers: 3\n  num_layers: 4\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml line 4: key 'num_layers' is given twice: keep one$"):
        load_config(tmp_path / "twice.yaml")
    (tmp_path / "empty.yaml").write_text("base: tiny\nmodel:\ncopy:\n  mix: joint\n")
    cfg = load_config(tmp_path / "empty.yaml")
    assert cfg.model == load_config("tiny").model and cfg.copy.mix == "joint"
    (tmp_path / "latin1.yaml").write_bytes("model:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8 text \(byte \d+\): save it as UTF-8$"):
        load_config(tmp_path / "latin1.yaml")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^config 'nope\.yaml' not found"):
        load_config("nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(bad)


def test_vocab_padding_is_megatron_style_and_reported():
    assert padded_vocab_size(49152, 128, 8) == 49152
    assert padded_vocab_size(50000, 128, 1) == 50048
    assert padded_vocab_size(50000, 128, 2) == 50176
    assert vocab_padding_note(300, 128, 2).startswith("model.vocab_size=300 padded to 512 (+212 ids")
    tiny = load_config("tiny").model
    assert vocab_padding_note(tiny.vocab_size, tiny.make_vocab_size_divisible_by, 1) is None


def test_cli_config_error_exits_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "model_check.py"), "--config", "tiny", "model.num_kv_heads=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: model.num_kv_heads=3 must divide model.num_heads=8 (valid: [1, 2, 4, 8])"
    ]


def test_the_batch_layout_is_world_then_dp_then_accumulation():
    """BatchLayout, which training, its preflight, the dry run and the planner all ask: dp = world /
    (tp x cp x pp), accumulation = global / (micro x dp); the world checked first, each refusal one line."""
    from cplm_dist.config import BatchLayout, ConfigError

    layout = BatchLayout.for_world(32, tp=2, pp=2, cp=2, micro=2, global_batch=64)
    assert (layout.world, layout.dp, layout.micro, layout.accumulation, layout.global_batch) == (32, 4, 2, 8, 64)
    cfg = load_config("tiny", ["parallel.cp=2", "train.micro_batch_size=2", "train.global_batch_size=12"])
    assert BatchLayout.of(cfg, 6) == BatchLayout(world=6, dp=3, micro=2, accumulation=2)
    with pytest.raises(ConfigError, match=r"^parallel.tp=1 x parallel.cp=2 x parallel.pp=1 = 2 does not divide WORLD_SIZE=5 "):
        BatchLayout.of(cfg, 5)
    with pytest.raises(ConfigError) as e:
        BatchLayout.of(cfg, 8)  # dp 4: micro 2 x 4 = 8 does not divide 12
    assert str(e.value) == ("train.global_batch_size=12 is not micro_batch_size=2 x dp=4 (=8) x an integer accumulation: "
                            "use one of [8, 16] or change micro_batch_size")


@pytest.mark.parametrize("path", sorted((CONFIG_DIR / "runs").glob("*.yaml")), ids=lambda p: p.stem)
def test_gpu_run_configs_add_up_at_their_node_count(path):
    """Each GPU starting point names its node count; its batch arithmetic must work there."""
    import re

    from cplm_dist.config import batch_layout
    from cplm_dist.distributed import check_world

    cfg = load_config(path)
    text = path.read_text()
    nodes = int(re.search(r"--nnodes (\d+)", text).group(1))
    per_node = int(re.search(r"on nodes of (\d+) x 80 GB GPUs", text.splitlines()[0]).group(1))
    world = nodes * per_node
    p = cfg.parallel
    model_parallel = p.tp * p.cp * p.pp  # dp = world / (tp x cp x pp): the batch arithmetic counts dp alone
    check_world(p.tp, world, p.pp, p.cp)
    assert world % model_parallel == 0 and p.tp <= 8, "tp stays inside a node"
    assert batch_layout(cfg, world // model_parallel) >= 1
    assert cfg.train.precision == "bf16" and cfg.data.seq_length <= cfg.model.max_seq_len
    if p.cp > 1:  # each sequence over cp ranks: 2 x cp chunks; the cp group inside a node up to 7B (K/V
        # gathered on NVLink), across nodes at 70B where tp takes the node (cplm-70b-32k, the planner's choice)
        assert cfg.data.seq_length % (2 * p.cp) == 0 and (p.tp * p.cp <= per_node or p.tp == per_node)


def test_long_context_run_config_and_preflight_count_cp(capsys):
    """configs/runs/cplm-1.7b-32k.yaml: 32k positions (max_seq_len and rope_theta raised with it),
    cp 2 on one node; preflight's layout counts dp = world / (tp x cp x pp) and refuses a world
    that tp x cp x pp does not divide."""
    from cplm_dist.train.preflight import main

    run = CONFIG_DIR / "runs" / "cplm-1.7b-32k.yaml"
    cfg = load_config(run)
    assert (cfg.data.seq_length, cfg.model.max_seq_len, cfg.parallel.cp) == (32768, 32768, 2)
    assert cfg.model.rope_theta > load_config("cplm-1.7b").model.rope_theta
    assert main(["--world", "8", "--config", str(run)]) == 0
    assert "layout: 8 processes = tp 1 x cp 2 x pp 1 x dp 4, ZeRO-1, global batch 64 = micro 1 x accumulation 16 x dp 4" \
        in capsys.readouterr().err
    assert main(["--world", "12", "--config", str(run), "parallel.cp=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.tp=1 x parallel.cp=8 x parallel.pp=1 = 8 does not divide WORLD_SIZE=12" in err[0], err
    big = CONFIG_DIR / "runs" / "cplm-70b-32k.yaml"  # cp x pp at 70B (cp across nodes), under DualPipeV
    assert main(["--world", "512", "--config", str(big)]) == 0
    assert "layout: 512 processes = tp 8 x cp 4 x pp 2 x dp 8, ZeRO-1, global batch 128 = micro 1 x accumulation 16 x dp 8" \
        in capsys.readouterr().err
    assert main(["--world", "4096", "--config", str(big)]) == 2  # 2 micro-batches a step: DualPipeV needs 2 x pp
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.pp_schedule=dualpipev at parallel.pp=2 needs >= 4 micro-batches a step" in err[0], err


def test_no_tool_shadows_a_standard_library_module():
    """`python tools/x.py` puts tools/ first on sys.path: a tools/profile.py would replace the
    standard library's `profile` (imported by cProfile, deep in megatron's imports) for every tool."""
    clashes = [p.name for p in (REPO / "tools").glob("*.py") if p.stem in sys.stdlib_module_names]
    assert clashes == []


def test_every_subpackage_is_packaged():
    """pyproject lists packages by hand (tools/ ships as cplm_dist_tools): none may be forgotten."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "cplm_dist").rglob("__init__.py")}
    configs = {".".join(("cplm_dist",) + p.relative_to(REPO).parts) for p in (REPO / "configs").rglob("*")
               if p.is_dir()} | {"cplm_dist.configs"}
    assert found | configs | {"cplm_dist.launch", "cplm_dist_tools"} == listed
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    launch = data.pop("cplm_dist.launch")  # launch/ ships as cplm_dist/launch: every script in it
    assert {p.name for p in (REPO / "launch").iterdir() if any(p.match(g) for g in launch)} == \
        {p.name for p in (REPO / "launch").iterdir() if p.name != "README.md"}
    # the copy head's GPU record of the flex path (cplm_dist/model/flex_record.py), once committed
    from cplm_dist.model.flex_record import RECORD

    assert data.pop("cplm_dist.model") == ["*.json"] and RECORD.match("*.json")
    # the configs, and the lm-eval task YAMLs shipped next to their Python
    assert set(data) == configs | {"cplm_dist.evaluation.harness_tasks"} and all(v == ["*.yaml"] for v in data.values())
