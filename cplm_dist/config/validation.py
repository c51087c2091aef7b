"""Validating a config: cross-field checks on the tree, each failure one line naming the field,
the value and the fix (a `ConfigError`, exit code 2 at the entry points).

`validate` runs at load (cplm_dist.config.loading.load_config); what depends on the launch (the
world size, hence dp) is checked when the world is known: `BatchLayout` here, world -> dp ->
accumulation in one place (the tp x cp x pp grid dividing the world, then the batch arithmetic),
for training, its preflight, the dry run and the planner alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from cplm_dist.config.backbones import backbone, backbones_with
from cplm_dist.config.sparse import validate_moe
from cplm_dist.config.tree import Config, ModelConfig
from cplm_dist.errors import ConfigError


def divisors(n: int) -> list[int]:
    """1 .. n, those that divide n: the valid values a message names (tp, pp, heads)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: Config) -> None:
    """Cross-field checks; each failure is one line naming the field, the value and the fix."""
    m, c, tp = cfg.model, cfg.copy, cfg.parallel.tp
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
        "model.ffn_hidden_size": m.ffn_hidden_size, "model.vocab_size": m.vocab_size,
        "model.max_seq_len": m.max_seq_len, "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "copy.num_heads": c.num_heads, "copy.head_dim": c.head_dim, "copy.chunk_size": c.chunk_size,
        "parallel.tp": tp, "parallel.pp": cfg.parallel.pp, "parallel.cp": cfg.parallel.cp,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer")
    for name, value in {"model.norm_eps": m.norm_eps, "model.init_std": m.init_std,
                        "model.rope_theta": m.rope_theta, "copy.init_std": c.init_std}.items():
        if not value > 0:
            raise ConfigError(f"{name}={value} must be > 0")
    validate_head_dim(m)
    if c.rope and c.head_dim % 2:
        raise ConfigError(f"copy.head_dim={c.head_dim} must be even when copy.rope=true")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
            f"(valid: {divisors(m.num_heads)})"
        )
    validate_data(cfg)
    validate_monitors(cfg)
    validate_train(cfg)
    validate_muon(cfg)
    check_tp_divides(m, tp)
    validate_pipeline(cfg)
    validate_context_parallel(cfg)
    validate_rope_scaling(m)
    validate_moe(cfg)
    if cfg.parallel.sequence_parallel and tp > 1 and cfg.data.seq_length % tp:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} is not divisible by parallel.tp={tp}, which "
            f"parallel.sequence_parallel=true needs (each tp rank holds seq_length/tp positions): "
            f"make seq_length a multiple of {tp} or set parallel.sequence_parallel=false")


def validate_head_dim(m: ModelConfig) -> None:
    """model.head_dim: given, any positive even width (q and k/v widths = heads x head_dim need not
    be hidden_size: Qwen3); null, hidden_size / num_heads, which must then be whole and even."""
    if m.head_dim is None:  # null and not a whole split (ModelConfig fills in a whole one)
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads} "
            f"(valid head counts: {divisors(m.hidden_size)[:12]}...), or set model.head_dim"
        )
    if m.head_dim < 1:
        raise ConfigError(f"model.head_dim={m.head_dim} must be a positive integer (or null: hidden_size / num_heads)")
    if m.head_dim % 2 and m.head_dim * m.num_heads == m.hidden_size:
        raise ConfigError(f"model.hidden_size/num_heads = {m.head_dim} must be even for rotary embeddings")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for rotary embeddings: use "
                          f"{m.head_dim - 1} or {m.head_dim + 1}")


def validate_pipeline(cfg: Config) -> None:
    """What DeepSpeed's pipeline engine needs at parallel.pp > 1."""
    pp, t = cfg.parallel.pp, cfg.train
    if pp == 1:
        return
    if cfg.model.num_layers < pp:
        raise ConfigError(f"parallel.pp={pp} exceeds model.num_layers={cfg.model.num_layers}: every stage needs a "
                          f"transformer layer; use parallel.pp <= {cfg.model.num_layers}")
    if cfg.parallel.pp_schedule == "dualpipev" and cfg.model.num_layers < 2 * pp:
        raise ConfigError(f"parallel.pp_schedule=dualpipev at parallel.pp={pp} needs model.num_layers >= {2 * pp} (two "
                          f"stages a rank, each with a transformer layer; it has {cfg.model.num_layers}): use parallel.pp <= "
                          f"{max(cfg.model.num_layers // 2, 1)} or parallel.pp_schedule=1f1b")
    if cfg.parallel.pp_schedule == "dualpipev" and t.eval_batches < 2 * pp:  # validation runs the schedule too
        raise ConfigError(f"parallel.pp_schedule=dualpipev at parallel.pp={pp} evaluates >= {2 * pp} micro-batches a "
                          f"validation pass, train.eval_batches={t.eval_batches}: use train.eval_batches >= {2 * pp}")
    if t.zero_stage > 1:
        raise ConfigError(f"train.zero_stage={t.zero_stage} with parallel.pp={pp}: DeepSpeed's pipeline engine accumulates "
                          "gradients across micro-batches itself, which ZeRO-2/3 would shard away; use train.zero_stage=1 "
                          "(it shards the optimizer states over dp)")
    if cfg.model.init_from:
        raise ConfigError(f"model.init_from with parallel.pp={pp}: starting from a HF Llama or a checkpoint is wired for "
                          "pp=1 only; drop model.init_from or train at parallel.pp=1")
    if t.precision == "bf16" and t.zero_stage == 0:
        raise ConfigError(f"train.precision=bf16 with train.zero_stage=0 at parallel.pp={pp}: DeepSpeed's bf16 optimizer "
                          "would clip with a norm that misses later stages' replicated parameters; use train.zero_stage=1")


def validate_context_parallel(cfg: Config) -> None:
    """parallel.cp > 1: the sequence cuts into 2 x cp equal chunks (each rank's two, Megatron's
    causal load balance), each of them whole under sequence parallelism too (with pipeline stages
    or without)."""
    cp, tp, T = cfg.parallel.cp, cfg.parallel.tp, cfg.data.seq_length
    if cp == 1:
        return
    unit = 2 * cp * (tp if cfg.parallel.sequence_parallel and tp > 1 else 1)
    if T % unit:
        what = f"2 x cp x tp = {unit} (sequence parallelism splits each chunk over tp)" if unit > 2 * cp else f"2 x cp = {unit}"
        near = [v for v in (T // unit * unit, T // unit * unit + unit) if v > 0]
        raise ConfigError(f"data.seq_length={T} is not divisible by {what}, which parallel.cp={cp} needs (each cp rank "
                          f"holds 2 of 2 x cp equal chunks): use data.seq_length={' or '.join(map(str, near))}, or another cp")


def validate_rope_scaling(m: ModelConfig) -> None:
    """model.rope_scaling: a rotary backbone, a factor > 1 (the type is checked as it loads)."""
    r = m.rope_scaling
    if r is None:
        return
    if backbone(m).positions != "rope":
        rotary = backbones_with(positions="rope")[0]
        raise ConfigError(f"model.rope_scaling is for rotary positions, which model.arch={m.arch} does not have (its "
                          f"positions are a learned table): drop model.rope_scaling or use model.arch={rotary}")
    if not r.factor > 1:
        raise ConfigError(f"model.rope_scaling.factor={r.factor} must be > 1 (how many times longer the context gets; "
                          "1 is no scaling: model.rope_scaling=null)")
    if r.type == "ntk" and m.head_dim < 4:
        raise ConfigError(f"model.rope_scaling.type=ntk needs a head dim of at least 4 (theta x factor^(d/(d-2))), "
                          f"this model's is {m.head_dim}: use model.rope_scaling.type=linear")


def check_tp_divides(m: ModelConfig, tp: int) -> None:
    """The heads, kv heads and MLP width split evenly over `tp` ranks (training, and loading a
    checkpoint at another tp)."""
    for name, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads),
                        ("model.ffn_hidden_size", m.ffn_hidden_size)):
        if value % tp:
            valid = [d for d in divisors(m.num_kv_heads) if m.ffn_hidden_size % d == 0]
            raise ConfigError(f"{name}={value} is not divisible by parallel.tp={tp} (valid tp for this model: {valid})")


def parse_split(split: str) -> list[float]:
    """Megatron's split string "98,2,0" -> normalised [train, valid, test] fractions."""
    try:
        parts = [float(p) for p in split.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data.split={split!r} must be up to three non-negative weights, e.g. '98,2,0'")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def validate_data(cfg: Config) -> None:
    d = cfg.data
    if d.seq_length < 1:
        raise ConfigError(f"data.seq_length={d.seq_length} must be a positive integer")
    if d.seq_length > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_length={d.seq_length} exceeds model.max_seq_len={cfg.model.max_seq_len}: "
            "lower one or raise the other"
        )
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be >= 0")
    validate_blend(d.blend, "data.blend")
    parse_split(d.split)
    validate_stages(cfg)


def validate_stages(cfg: Config) -> None:
    """data.stages: well formed, or one line naming the problem."""
    d = cfg.data
    if not d.stages:
        return
    if d.blend:
        raise ConfigError("data.blend and data.stages are both set: give the mixture once (data.blend is the "
                          "one-stage form of data.stages: [{from_step: 0, blend: [...]}])")
    if d.stages[0].from_step != 0:
        raise ConfigError(f"data.stages[0].from_step={d.stages[0].from_step}: the first stage must begin at "
                          "from_step 0 (the run's first step)")
    for i, (before, stage) in enumerate(zip(d.stages, d.stages[1:]), start=1):
        if stage.from_step <= before.from_step:
            raise ConfigError(f"data.stages[{i}].from_step={stage.from_step} is not after data.stages[{i - 1}]"
                              f".from_step={before.from_step}: list the stages in the order they begin")
    for i, stage in enumerate(d.stages):
        if stage.from_step >= cfg.train.train_steps:
            raise ConfigError(f"data.stages[{i}].from_step={stage.from_step} is not before train.train_steps="
                              f"{cfg.train.train_steps}: the stage would never run; drop it or raise train.train_steps")
        if not stage.blend:
            raise ConfigError(f"data.stages[{i}].blend is empty: add at least one {{path: <prefix>, weight: 1.0}}")
        validate_blend(stage.blend, f"data.stages[{i}].blend")


def validate_blend(blend: list, name: str) -> None:
    """Each weight > 0 or `tokens`; a blend weighs all its entries by tokens or all by numbers (a
    number beside token counts would mean nothing)."""
    by_tokens = [j for j, e in enumerate(blend) if e.weight == "tokens"]
    for j, entry in enumerate(blend):
        if entry.weight != "tokens" and not entry.weight > 0:
            raise ConfigError(f"{name}[{j}].weight={entry.weight} must be > 0 or 'tokens' (drop the entry instead)")
    numbers = [j for j in range(len(blend)) if j not in by_tokens]
    if by_tokens and numbers:
        raise ConfigError(f"{name} mixes weight: tokens ({name}[{by_tokens[0]}]) with a number ({name}[{numbers[0]}]"
                          f".weight={blend[numbers[0]].weight}): weigh every entry by tokens, or give every entry a number")


def validate_monitors(cfg: Config) -> None:
    """Spike detection, the live diagnostics and in-loop evaluation: their fields, and the layouts
    that run them (the whole model on one tp group: pp 1, cp 1, ZeRO <= 2)."""
    t, p = cfg.train, cfg.parallel
    if t.spike_window < 0 or t.diagnostics_interval < 0 or t.eval_task_samples < 1:
        raise ConfigError("train.spike_window and train.diagnostics_interval must be >= 0 (0 = off), "
                          "train.eval_task_samples >= 1")
    if not t.spike_zscore > 0:
        raise ConfigError(f"train.spike_zscore={t.spike_zscore} must be > 0 (OLMo-core-style monitors use 4-6)")
    known = ("induction", "mqar", "spamlang", "phonebook")
    unknown = [task for task in t.eval_tasks if task not in known]
    if unknown:
        raise ConfigError(f"train.eval_tasks names {unknown[0]!r}: choose from {list(known)}")
    bad = [f"{name}={value}" for name, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp)) if value > 1]
    bad += [f"train.zero_stage={t.zero_stage}"] if t.zero_stage == 3 else []
    for field, on in (("train.diagnostics_interval", t.diagnostics_interval > 0),
                      ("train.eval_tasks", bool(t.eval_tasks) or bool(t.eval_task_lengths))):
        if on and bad:
            raise ConfigError(f"{field} runs on the whole model of one tp group, not at {', '.join(bad)}: turn it off "
                              "for this layout, or measure the run's checkpoints with tools/grad_bottleneck.py and "
                              "tools/evaluate.py")
    for length in t.eval_task_lengths:
        if not 32 <= length <= cfg.model.max_seq_len:
            raise ConfigError(f"train.eval_task_lengths has {length}: each must lie in [32, model.max_seq_len="
                              f"{cfg.model.max_seq_len}]")


def validate_train(cfg: Config) -> None:
    t, o = cfg.train, cfg.optim
    for name, value in {"train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
                        "train.train_steps": t.train_steps, "train.log_interval": t.log_interval,
                        "train.eval_interval": t.eval_interval, "train.eval_batches": t.eval_batches,
                        "train.save_interval": t.save_interval, "train.keep_last": t.keep_last,
                        "train.max_bad_steps": t.max_bad_steps}.items():
        if value < 1:
            raise ConfigError(f"{name}={value} must be a positive integer")
    for name, value in (("train.reduce_bucket_size", t.reduce_bucket_size),
                        ("train.allgather_bucket_size", t.allgather_bucket_size),
                        ("train.stage3_prefetch_bucket_size", t.stage3_prefetch_bucket_size)):
        if value < 1:
            raise ConfigError(f"{name}={value} must be a positive number of elements (DeepSpeed's default: 5e8, 5e8, 5e7)")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage={t.zero_stage} is not valid: choose one of [0, 1, 2, 3]")
    if cfg.loss.chunk_rows < 1:
        raise ConfigError(f"loss.chunk_rows={cfg.loss.chunk_rows} must be a positive integer")
    if cfg.loss.impl == "chunked" and t.zero_stage == 3:
        raise ConfigError("loss.impl=chunked with train.zero_stage=3: ZeRO-3 gathers the LM-head weight only inside "
                          "its module's forward, which the chunked loss bypasses; use loss.impl=dense or zero_stage<=2")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}"
        )
    if not 0 < o.lr or not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.lr={o.lr} and optim.min_lr={o.min_lr} must satisfy 0 <= min_lr <= lr, lr > 0")
    if o.warmup_steps < 0 or o.warmup_steps > t.train_steps:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be between 0 and train.train_steps={t.train_steps}")
    if not 0 <= o.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be within [0, 1]")
    if o.weight_decay < 0 or o.clip_grad < 0:
        raise ConfigError("optim.weight_decay and optim.clip_grad must be >= 0")
    for name, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{name}={value} must be within [0, 1) (e.g. 0.9, 0.95)")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps} must be > 0 (e.g. 1e-8)")
    if not t.collective_timeout_minutes > 0:
        raise ConfigError(f"train.collective_timeout_minutes={t.collective_timeout_minutes} must be > 0")
    if not t.join_timeout_minutes > 0:
        raise ConfigError(f"train.join_timeout_minutes={t.join_timeout_minutes} must be > 0 (e.g. 5)")
    if not t.lock_stale_minutes > 0:
        raise ConfigError(f"train.lock_stale_minutes={t.lock_stale_minutes} must be > 0 (e.g. 10)")
    if not t.reshape_timeout_minutes > 0:
        raise ConfigError(f"train.reshape_timeout_minutes={t.reshape_timeout_minutes:g} must be > 0 (e.g. 120)")
    if t.keep_every < 0:
        raise ConfigError(f"train.keep_every={t.keep_every} must be >= 0 (0: only train.keep_last decides)")
    a, b = (t.profile_steps + [0, 0])[:2]
    if t.profile_steps and (len(t.profile_steps) != 2 or not 1 <= a <= b <= t.train_steps):
        raise ConfigError(f"train.profile_steps={t.profile_steps} must be [first, last] steps with 1 <= first <= last <= "
                          f"train.train_steps={t.train_steps} ([] = no profile)")
    if not str(t.out_dir).strip():
        raise ConfigError("train.out_dir is empty: name the directory the run writes to")
    decay_start = t.train_steps - int(round(o.decay_fraction * t.train_steps))
    if o.schedule == "wsd" and o.warmup_steps > decay_start:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} overlaps the WSD decay, which starts at step {decay_start} "
                          f"(optim.decay_fraction={o.decay_fraction} of train.train_steps={t.train_steps}): "
                          "lower one of them")
    if t.precision == "fp32" and t.grad_accum_dtype == "bf16":
        raise ConfigError("train.grad_accum_dtype=bf16 with train.precision=fp32: fp32 parameters accumulate fp32 "
                          "gradients; drop train.grad_accum_dtype or train in train.precision=bf16")
    if t.precision == "bf16" and t.grad_accum_dtype == "fp32" and t.zero_stage != 1:
        raise ConfigError(f"train.grad_accum_dtype=fp32 with train.precision=bf16 at train.zero_stage={t.zero_stage}: "
                          "DeepSpeed accumulates bf16 gradients in fp32 only in its ZeRO-1 bf16 optimizer; use "
                          "train.zero_stage=1 or drop train.grad_accum_dtype")
    if t.precision == "bf16" and t.zero_stage == 0 and cfg.parallel.tp > 1 and o.clip_grad > 0:
        raise ConfigError("train.precision=bf16 with train.zero_stage=0 at parallel.tp>1 and optim.clip_grad>0: DeepSpeed's "
                          "bf16 stage-0 optimizer clips with a norm that misses the other tp ranks' shards; use "
                          "train.zero_stage=1 (it also shards the optimizer states)")


def validate_muon(cfg: Config) -> None:
    """optim.muon's ranges, and the layouts Muon is exact at: ZeRO 0-2 in fp32, ZeRO-1/2 in bf16
    (cplm_dist.training.zero_partitions); DeepSpeed's other optimizer wrappers are refused."""
    m, t = cfg.optim.muon, cfg.train
    if m.lr is not None and not m.lr > 0:
        raise ConfigError(f"optim.muon.lr={m.lr} must be > 0, or null to take optim.lr")
    if not 0 <= m.momentum < 1:
        raise ConfigError(f"optim.muon.momentum={m.momentum} must be within [0, 1) (e.g. 0.95)")
    if m.ns_steps < 1:
        raise ConfigError(f"optim.muon.ns_steps={m.ns_steps} must be a positive integer (e.g. 5)")
    if not m.rms_scale >= 0:
        raise ConfigError(f"optim.muon.rms_scale={m.rms_scale} must be >= 0 (0.2 matches AdamW's update RMS)")
    if cfg.optim.name != "muon":
        return
    if t.zero_stage == 3:
        raise ConfigError("optim.name=muon with train.zero_stage=3: ZeRO-3 partitions every matrix over dp, so "
                          "no rank holds one whole; use train.zero_stage <= 2 (1 or 2 shard Muon's momentum)")
    if t.precision == "bf16" and t.zero_stage == 0:
        raise ConfigError("optim.name=muon with train.precision=bf16 at train.zero_stage=0: DeepSpeed's bf16 stage-0 "
                          "wrapper flattens the matrices Muon needs whole; use train.zero_stage=1")
    if t.precision == "bf16" and t.grad_accum_dtype == "fp32":
        raise ConfigError("optim.name=muon with train.grad_accum_dtype=fp32: DeepSpeed's BF16_Optimizer lays out its "
                          "partitions as Muon is not adapted to; drop train.grad_accum_dtype or use optim.name=adamw")


@dataclass(frozen=True)
class Layout:
    """How a job's ranks split the model: tp x pp x cp x dp ranks, the ZeRO stage, the pipeline
    schedule. The one record of a parallel layout: a checkpoint's manifest keeps it (`as_json`,
    cplm_dist.checkpoint.manifest), the dry run traces it with its batch (RunLayout,
    cplm_dist.profiling.dry_run)."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    cp: int = 1  # an optional field of the manifest's format 2: a checkpoint saved without it is cp 1
    pp_schedule: str = "1f1b"  # optional too: which stages a pipeline rank holds (DualPipeV: two)
    ep: int = 1  # optional too: the ranks a sparse model's experts are spread over (parallel.ep; absent = 1)

    @classmethod
    def of(cls, cfg: Config, tp: int, dp: int) -> Layout:
        p = cfg.parallel
        return cls(tp=tp, pp=p.pp, dp=dp, zero_stage=cfg.train.zero_stage, cp=p.cp,
                   pp_schedule=p.pp_schedule if p.pp > 1 else "1f1b", ep=p.ep)

    @property
    def grad_ranks(self) -> int:
        """The ranks gradients are reduced over and ZeRO partitions over: dp x cp."""
        return self.dp * self.cp

    def as_json(self) -> dict:
        """The manifest's layout: cp and ep only where they are > 1, pp_schedule only where it is
        not 1F1B (what earlier readers know stays as it was)."""
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "zero_stage": self.zero_stage}
        return {**out, **({"cp": self.cp} if self.cp > 1 else {}),
                **({"pp_schedule": self.pp_schedule} if self.pp_schedule != "1f1b" else {}),
                **({"ep": self.ep} if self.ep > 1 else {})}

    def __str__(self) -> str:
        schedule = f" {self.pp_schedule}" if self.pp_schedule != "1f1b" else ""
        return (f"tp={self.tp} pp={self.pp}{schedule}" + (f" cp={self.cp}" if self.cp > 1 else "")
                + f" dp={self.dp}" + (f" ep={self.ep}" if self.ep > 1 else "") + f" ZeRO-{self.zero_stage}")


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch spreads over a job of `world` ranks: dp = world / (tp x cp x pp) replicas
    (cp ranks share a replica's sequences, pp stages its layers), each taking `accumulation`
    micro-batches of `micro` sequences a step, so global = micro x accumulation x dp."""

    world: int
    dp: int
    micro: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accumulation * self.dp

    @classmethod
    def of(cls, cfg: Config, world: int) -> BatchLayout:
        """cfg's layout on `world` ranks, or the ConfigError training raises (`for_world`)."""
        p, t = cfg.parallel, cfg.train
        layout = cls.for_world(world, tp=p.tp, pp=p.pp, cp=p.cp, micro=t.micro_batch_size, global_batch=t.global_batch_size)
        check_schedule(cfg, layout)
        return layout

    @classmethod
    def for_world(cls, world: int, *, tp: int, pp: int = 1, cp: int = 1, micro: int, global_batch: int) -> BatchLayout:
        """The layout of a global batch of `micro`-sequence micro-batches on `world` ranks at tp x cp
        x pp, or a ConfigError with the numbers: tp x cp x pp must divide the world
        (`check_world`), then micro x dp the global batch (`accumulation_steps`)."""
        check_world(tp, world, pp, cp)
        dp = world // (tp * cp * pp)
        return cls(world, dp, micro, accumulation_steps(global_batch, micro, dp))


def check_schedule(cfg: Config, layout: BatchLayout) -> None:
    """DualPipeV runs at least 2 x pp micro-batches a step (each rank's two stages both busy in
    its steady state), or a ConfigError with the global batches that give it that many."""
    pp = cfg.parallel.pp
    if pp > 1 and cfg.parallel.pp_schedule == "dualpipev" and layout.accumulation < 2 * pp:
        per_step = layout.micro * layout.dp
        raise ConfigError(f"parallel.pp_schedule=dualpipev at parallel.pp={pp} needs >= {2 * pp} micro-batches a step, "
                          f"this layout has {layout.accumulation} (train.global_batch_size={layout.global_batch} = micro "
                          f"{layout.micro} x dp {layout.dp} x {layout.accumulation}): use train.global_batch_size >= "
                          f"{2 * pp * per_step} or parallel.pp_schedule=1f1b")


def check_world(tp_size: int, world_size: int, pp_size: int = 1, cp_size: int = 1) -> None:
    """tp x cp x pp divides the world (dp = world / (tp x cp x pp) whole), or a ConfigError naming the valid products."""
    if cp_size > 1 and world_size % (tp_size * cp_size * pp_size):
        raise ConfigError(f"parallel.tp={tp_size} x parallel.cp={cp_size} x parallel.pp={pp_size} = "
                          f"{tp_size * cp_size * pp_size} does not divide WORLD_SIZE={world_size} (dp = world / (tp x cp x pp) "
                          f"must be whole; tp x cp x pp must be one of {divisors(world_size)})")
    if world_size % (tp_size * pp_size):
        valid = divisors(world_size)
        if pp_size == 1:
            raise ConfigError(f"parallel.tp={tp_size} does not divide WORLD_SIZE={world_size} "
                              f"(dp = world / tp must be whole; valid tp here: {valid})")
        raise ConfigError(f"parallel.tp={tp_size} x parallel.pp={pp_size} = {tp_size * pp_size} does not divide "
                          f"WORLD_SIZE={world_size} (dp = world / (tp x pp) must be whole; tp x pp must be one of {valid})")


def accumulation_steps(global_batch: int, micro: int, dp_size: int) -> int:
    """Gradient-accumulation steps from micro x accumulation x dp = global, or a ConfigError with the numbers."""
    per_step = micro * dp_size
    if global_batch % per_step:
        lower = (global_batch // per_step) * per_step
        valid = [v for v in (lower, lower + per_step) if v > 0]
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not micro_batch_size={micro} x "
            f"dp={dp_size} (={per_step}) x an integer accumulation: use one of {valid} or change micro_batch_size"
        )
    return global_batch // per_step


def batch_layout(cfg: Config, dp_size: int) -> int:
    """cfg's gradient-accumulation steps at `dp_size` replicas (`accumulation_steps`)."""
    return accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp_size)
