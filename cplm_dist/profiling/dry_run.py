"""A training layout run at full scale with no GPU: each distinct rank of the layout builds its
modules with the code training uses (cplm_dist.model: megatron-core layers, the copy head, the
loss; the pipeline stage DeepSpeed would hold) at the real shapes, in a fake process group of the
real world size (cplm_dist.profiling.fake_world), under FakeTensorMode, and runs the micro-batches
it holds at once through forward and backward, while torch's MemTracker records the bytes alive
by kind and the profiler's collective counter (cplm_dist.profiling.measure.CommTimer) the
collectives the model issues.

    result = dry_run(cfg, gpus=512, device=DEVICES["h200"])
    result.fits, result.heaviest, result.as_json()

A rank's role is its tp rank, pipeline stage and cp rank (its dp replicas are alike). tp ranks differ only
in how much of their vocabulary shard is Megatron's padding and, under sequence parallelism, in
which positions their copy-head queries are (`alike_ranks`): one tp rank is traced per distinct
kind and the others share its figures (`traced_as`). Under context parallelism (parallel.cp = c > 1,
with pipeline stages or without) every cp rank is traced: each holds T/c positions of each sequence (its two chunks), runs
attention and the copy head over the prefix its chunks see (cp rank 0's second chunk sees all T,
the largest blocks), and issues the cp group's gathers, which the collective counter files under
"cp/" and the communication model (cplm_dist.profiling.communication) predicts. The dp x cp group
reduces the gradients and partitions ZeRO's states: modelled as dp over dp x cp ranks. A sparse
model (model.moe) is traced with its expert groups (parallel.ep, parallel.expert_tp) in the fake
world, routing balanced (cplm_dist.profiling.dry_run_experts: a fake tensor has no values to route
by): each rank holds E / ep experts of each sparse layer and receives as many tokens as it sends,
so the ep ranks of a tp rank and stage are alike and one is traced for them (its `ep_rank`); its
dispatcher's all-to-alls are counted under "ep/", and its experts' optimizer states and gradients
modelled over the expert-dp ranks (cplm_dist.profiling.expert_cost). What each role runs:

    pp = 1   min(accumulation, 2) micro-batches, each forward then backward: the second runs with
             the first one's gradients alive, as in a step that accumulates
    pp > 1   1F1B as DeepSpeed's engine runs it on stage s: k = min(pp - s, accumulation)
             forwards held, the first backward, one more forward (when the step has more), then
             the remaining backwards; each stage's input is a fake received activation, a non-last
             stage's backward starts from a fake received gradient. Under DualPipeV a rank runs its
             two stages a micro-batch (the last rank's second on the first's output), p of them
             and one more through the first stage held at once, as memory.in_flight counts
             (cplm_dist.profiling.dry_run_schedule)

What is traced (FakeTensorMode): the parameters in the training dtype (DeepSpeed's bf16 copy), the
activations, the backward's temporaries and the gradients autograd makes (ZeRO-2/3 reduce and
release each one as it is made: dropped at once), and the tp / sp collectives (CommTimer, per
micro-batch, scaled to the step's accumulation). The pipeline's sends are counted from the
boundary tensors the stage actually produced and received, by the engine's rule (a tp partition
of the hidden states, or its sequence shard, plus the ids and labels).

What DeepSpeed's engine owns is not traced and is added from the estimator's arithmetic
(cplm_dist.profiling.memory.state_bytes_per_parameter, over the traced parameter count), marked
"modelled" in the table and the JSON: the optimizer states (AdamW's m, v and fp32 master copy,
ZeRO-partitioned; with optim.name=muon one momentum buffer for the layers' matrices), its gradient reduction buckets, the gradients it keeps for the optimizer step and the step's temporaries, the
dp collectives and the tied embedding's all-reduce (cplm_dist.profiling.communication). (Its
engine builds under fake tensors once Module.to may swap fake parameters, but its step reads
values, .item() on an overflow check, which fake tensors do not have.) A role's peak is

    parameters (traced) + optimizer states + gradient buckets (modelled)
        + max(what the traced forward and backward added at their peak, the optimizer step: gradients + temporaries (modelled))

and it fits when at most `headroom` (the planner's 90%) of the device's memory. The roofline
step time (cplm_dist.profiling.roofline: the traced operators at the device's peak FLOPs and
memory bandwidth, the traced tp bytes at the planner's NVLink bandwidth, the 1F1B bubble, the
modelled dp bytes unhidden, and with Muon its Newton-Schulz FLOPs at the device's peak and its tp
gathers, cplm_dist.profiling.muon_cost) is a model of the eager operator sequence, beside the planner's
prediction (compiled layers fuse its pointwise operators away). The traced FLOPs of a dp
replica's step are set beside throughput.flops_per_token's, the FLOPs MFU counts.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from cplm_dist.config import BatchLayout, Config, Layout
from cplm_dist.distributed import ParallelDims
from cplm_dist.model.counting import parameter_count, replicated_parameters
from cplm_dist.model.loss import padded_vocab_size
from cplm_dist.model.parallel.stages import loss_stage, pipeline_stages
from cplm_dist.profiling import communication
from cplm_dist.config.sparse import check_expert_world, expert_tp
from cplm_dist.profiling.dry_run_experts import balanced_routing, check_traceable, traced_experts
from cplm_dist.profiling.dry_run_schedule import RoleSchedule
from cplm_dist.profiling.expert_cost import ExpertGroups, local_expert_elements
from cplm_dist.profiling.fake_world import fake_rank, rank_of
from cplm_dist.profiling.memory import bubble, bucket_bytes, optimizer_bytes, stage_estimates, state_bytes_per_parameter
from cplm_dist.profiling.muon_cost import muon_step_cost
from cplm_dist.profiling.planner import Cluster, predict
from cplm_dist.profiling.roofline import Device, Roofline

HEADROOM = 0.9  # the share of a device's memory a layout may fill (the planner's Cluster.headroom)


@dataclass(frozen=True, kw_only=True)
class RunLayout(Layout):
    """A parallel layout (cplm_dist.config.Layout) with the batch and sequence it trains on: what
    the dry run traces."""

    world: int
    micro_batch: int
    accumulation: int
    seq_len: int
    precision: str

    @property
    def act_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def as_json(self) -> dict:
        """The dry run's report: cp always (not the manifest's form)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "zero_stage": self.zero_stage}


def layout_of(cfg: Config, gpus: int) -> RunLayout:
    """The layout cfg trains with on `gpus` ranks, or the ConfigError training would raise (a tp x
    cp x pp that does not divide the world, batch arithmetic that does not work; the heads and pp
    bounds are checked when the config loads)."""
    batch = BatchLayout.of(cfg, gpus)
    check_expert_world(cfg, gpus)  # a sparse model's ep x expert_tp dividing a stage's ranks
    check_traceable(cfg)
    return RunLayout(**asdict(Layout.of(cfg, cfg.parallel.tp, batch.dp)), world=gpus, micro_batch=batch.micro,
                     accumulation=batch.accumulation, seq_len=cfg.data.seq_length, precision=cfg.train.precision)


def alike_ranks(cfg: Config, tp: int, last_stage: bool) -> dict[int, list[int]]:
    """{traced tp rank: the tp ranks alike to it}. Ranks are alike when they hold as many real
    (unpadded) vocabulary rows (cplm_dist.model.parts.vocabulary_shard), except at the head's
    stage under sequence parallelism, where each rank's copy-head queries are its own positions
    of the sequence and score as many earlier keys: every rank is its own role there."""
    if last_stage and cfg.parallel.sequence_parallel and tp > 1:
        return {r: [r] for r in range(tp)}
    m = cfg.model
    v_local = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    classes: dict[int, list[int]] = {}
    for r in range(tp):
        real = max(0, min(v_local, m.vocab_size - r * v_local))
        classes.setdefault(real, []).append(r)
    return {ranks[0]: ranks for ranks in classes.values()}


@dataclass
class RoleTrace:
    """What one rank's traced micro-batches showed (bytes; collectives per optimizer step)."""

    parameters: int
    parameter_bytes: int
    peak_bytes: int  # MemTracker's peak of the forward and backward, everything alive
    by_kind: dict[str, int]  # that peak's composition (parameters, gradients, activations, temporaries, ...)
    collectives: dict[str, float]  # "<group>/<collective>": bytes a step, traced
    boundary: dict[str, float]  # "pp/send", "pp/recv": bytes a step, from the boundary tensors
    micro_batches: int  # traced
    roofline_s: float  # the traced micro-batches' operators at the roofline, per micro-batch
    flops: float  # per micro-batch
    seconds: float  # wall time of the trace
    ep_rank: int = 0  # a sparse model's: which E / ep experts of each sparse layer the rank holds


@dataclass
class Role:
    tp_rank: int
    pp_stage: int
    traced_as: int  # the tp rank whose trace this role shares
    trace: RoleTrace
    modelled: dict  # bytes: optimizer_states, optimizer_step; collectives {key: bytes}
    peak_bytes: float
    estimate_bytes: float
    modelled_collectives: dict[str, float] = field(default_factory=dict)  # the communication model of the same collectives
    cp_rank: int = 0

    @property
    def error(self) -> float:
        """The estimator against the trace: (estimate - traced) / traced."""
        return (self.estimate_bytes - self.peak_bytes) / self.peak_bytes

    def as_json(self) -> dict:
        t = self.trace
        return {"tp_rank": self.tp_rank, "pp_stage": self.pp_stage, "cp_rank": self.cp_rank, "ep_rank": t.ep_rank,
                "traced_as": self.traced_as,
                "parameters": t.parameters, "peak_bytes": self.peak_bytes, "estimate_bytes": self.estimate_bytes,
                "traced": {"peak_bytes": t.peak_bytes, "by_kind": t.by_kind, "micro_batches": t.micro_batches,
                           "flops_per_micro_batch": t.flops, "roofline_s_per_micro_batch": t.roofline_s},
                "modelled": self.modelled,
                "collectives": {**t.collectives, **t.boundary, **self.modelled["collectives"]},
                "collectives_traced": t.collectives, "collectives_boundary": t.boundary,
                "collectives_modelled": self.modelled["collectives"],
                "collectives_communication_model": self.modelled_collectives}


@dataclass
class DryRun:
    cfg: Config
    layout: RunLayout
    device: Device
    roles: list[Role]
    roofline_step_s: float
    planner_step_s: float
    seconds: float

    @property
    def heaviest(self) -> Role:
        return max(self.roles, key=lambda r: r.peak_bytes)

    @property
    def replica_flops(self) -> tuple[float, float]:
        """(FLOPs of one dp replica's step as traced: every role's micro-batch x accumulation, the
        recomputed forward included; the same from throughput.flops_per_token, the FLOPs MFU counts)."""
        from cplm_dist.training.throughput import flops_per_token

        L = self.layout
        traced = sum(r.trace.flops for r in self.roles) * L.accumulation
        return traced, flops_per_token(self.cfg, L.seq_len) * L.micro_batch * L.seq_len * L.accumulation

    @property
    def fits(self) -> bool:
        return self.heaviest.peak_bytes <= HEADROOM * self.device.memory_bytes

    def as_json(self) -> dict:
        return {"config": self.cfg.model.name, "world": self.layout.world, "layout": self.layout.as_json(),
                "micro_batch": self.layout.micro_batch, "accumulation": self.layout.accumulation,
                "seq_len": self.layout.seq_len, "precision": self.layout.precision,
                "total_parameters": parameter_count(self.cfg)["total"],
                "replicated_parameters": replicated_parameters(self.cfg),
                "device": self.device.name, "device_bytes": self.device.memory_bytes, "headroom": HEADROOM,
                "fits": self.fits, "replica_flops_traced": self.replica_flops[0], "replica_flops_model": self.replica_flops[1],
                "roofline_step_s": self.roofline_step_s, "planner_step_s": self.planner_step_s,
                "seconds": self.seconds, "roles": [r.as_json() for r in self.roles]}


def _build(cfg: Config, dims: ParallelDims, layout: RunLayout, device):
    from cplm_dist.model.cplm import build_model
    from cplm_dist.training.pipeline import build_pipeline_model

    dtype = torch.bfloat16 if layout.precision == "bf16" else torch.float32  # DeepSpeed's bf16 copy of the model
    if layout.pp > 1:
        return build_pipeline_model(cfg, dims, device=device, dtype=dtype)
    return build_model(cfg, tp_group=dims.tp_group, device=device, dtype=dtype, compile_layers=False, cp_group=dims.cp_group)


def trace_rank(cfg: Config, dims: ParallelDims, layout: RunLayout, device: torch.device | str = "cpu",
               roofline_device: Device | None = None) -> RoleTrace:
    """Build this rank's modules and run its micro-batches (module docstring), in whatever world
    and tensor mode is active: a fake rank under FakeTensorMode (`dry_run`), or a real job of
    real tensors (how the tests hold the dry run to the real thing)."""
    from cplm_dist.model.parallel.context import context_of
    from cplm_dist.profiling.live_tensors import StepTracker, peak_by_kind
    from cplm_dist.profiling.measure import CommTimer
    from cplm_dist.profiling.roofline import DEVICES

    start = time.perf_counter()
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    module = _build(cfg, dims, layout, device)
    params = {id(p): p for p in module.parameters()}.values()
    stage = pipeline_stages(cfg, layout.pp, layout.tp)[dims.pp_rank] if layout.pp > 1 else None
    hooks = []
    if layout.zero_stage >= 2:  # DeepSpeed reduces each gradient as it is made and keeps only its partition
        hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in params if p.requires_grad]
    schedule = RoleSchedule(module, cfg, layout, stage, device, context_of(dims))
    roof = Roofline(roofline_device or DEVICES["h200"], layout.precision)
    with StepTracker() as tracker, CommTimer(dims, device) as comm, roof:
        tracker.track_external(module)
        schedule.counted = comm.by_name
        schedule.run()
    for h in hooks:
        h.remove()
    by_kind = peak_by_kind(tracker)
    n, scale = schedule.micro_batches, layout.accumulation / schedule.micro_batches
    collectives = {f"{kind}/{name}": size * scale for (kind, name), (_, size) in comm.by_name.items()}
    return RoleTrace(parameters=sum(p.numel() for p in params),
                     parameter_bytes=sum(p.numel() * p.element_size() for p in params),
                     peak_bytes=by_kind.pop("total"), by_kind=by_kind, collectives=collectives,
                     boundary={k: v * scale for k, v in schedule.boundary.items()}, micro_batches=n,
                     roofline_s=roof.seconds / n, flops=roof.flops / n, seconds=time.perf_counter() - start,
                     ep_rank=dims.ep_rank)


def trace_role(cfg: Config, layout: RunLayout, *, tp_rank: int, pp_stage: int, device: Device, cp_rank: int = 0) -> RoleTrace:
    """`trace_rank` of one role in a fake job of layout.world ranks, under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank = rank_of(tp_rank=tp_rank, pp_stage=pp_stage, tp=layout.tp, dp=layout.dp, cp_rank=cp_rank, cp=layout.cp)
    p = cfg.parallel
    with fake_rank(rank=rank, world=layout.world, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=p.ep,
                   expert_tp=p.expert_tp) as dims, balanced_routing(cfg), FakeTensorMode():
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints the whole rank topology at rank 0
            return trace_rank(cfg, dims, layout, "cpu", device)


def modelled(cfg: Config, layout: RunLayout, trace: RoleTrace, stage: int) -> dict:
    """What DeepSpeed's engine adds to a traced role (module docstring), from the estimator's arithmetic."""
    t = cfg.train
    n = trace.parameters
    _, g_b, o_b = state_bytes_per_parameter(layout.precision, layout.zero_stage, layout.grad_ranks, t.grad_accum_dtype)
    held = pipeline_stages(cfg, layout.pp, layout.tp)[stage]
    experts = local_expert_elements(cfg, held, layout.tp)  # a sparse model's: partitioned over the expert-dp ranks
    _, ge_b, oe_b = state_bytes_per_parameter(layout.precision, layout.zero_stage, ExpertGroups.of(
        cfg, tp=layout.tp, cp=layout.cp, dp=layout.dp).expert_dp, t.grad_accum_dtype)
    collectives = {}
    full = communication.step_bytes(cfg, tp=layout.tp, dp=layout.dp, zero=layout.zero_stage, micro_batch=layout.micro_batch,
                                    accumulation=layout.accumulation, seq_len=layout.seq_len, precision=layout.precision,
                                    activation_checkpointing=t.activation_checkpointing,
                                    sequence_parallel=cfg.parallel.sequence_parallel, pp=layout.pp, stage=stage, cp=layout.cp)
    flops, muon = muon_step_cost(cfg, held, tp=layout.tp, partitions=layout.grad_ranks, zero=layout.zero_stage)
    for key, size in full.items():  # what the engine moves: dp, the tied gradient, the partitioned p2p gathers, Muon's
        if key.startswith(("dp/", "edp/", "tied/")) or key in muon or (
                key.startswith("tp/") and layout.pp > 1 and key == "tp/all_gather_into_tensor" and not cfg.parallel.sequence_parallel):
            collectives[key] = size
    buckets = bucket_bytes(cfg, zero=layout.zero_stage, pp=layout.pp, act_bytes=layout.act_bytes)
    states, temporaries = optimizer_bytes(cfg, held, layout.tp, n - experts, o_b, layout.zero_stage, layout.grad_ranks)
    states += experts * oe_b
    temporaries += 4 * experts / (ExpertGroups.of(cfg, tp=layout.tp, cp=layout.cp, dp=layout.dp).expert_dp
                                  if layout.zero_stage >= 1 else 1)
    grads = (n - experts) * g_b + experts * ge_b
    return {"optimizer_states": states, "gradient_buckets": buckets, "optimizer_step": grads + temporaries,
            "optimizer_flops": flops, "collectives": collectives, "communication_model": full}


def _role(cfg: Config, layout: RunLayout, trace: RoleTrace, tp_rank: int, traced_as: int, stage: int, estimate,
          cp_rank: int = 0) -> Role:
    extra = modelled(cfg, layout, trace, stage)
    activity = trace.peak_bytes - trace.parameter_bytes
    params = trace.parameter_bytes if layout.zero_stage < 3 else trace.parameter_bytes / layout.grad_ranks
    peak = params + extra["optimizer_states"] + extra["gradient_buckets"] + max(activity, extra["optimizer_step"])
    model = extra.pop("communication_model")  # less what the engine moves: the model's own collectives, as traced
    return Role(tp_rank, stage, traced_as, trace, extra, peak, estimate.total,
                {k: v for k, v in model.items() if k not in extra["collectives"]}, cp_rank)


def roofline_step(cfg: Config, layout: RunLayout, roles: list[Role], cluster: Cluster, device: Device | None = None) -> float:
    """The slowest stage's traced micro-batch at the roofline plus its traced tp bytes at the
    intra-node bandwidth and its traced cp and ep bytes (a sparse model's token dispatch) at the links
    their groups span, over the step's micro-batches and the schedule's bubble (memory.bubble),
    plus the modelled dp (over dp x cp), expert-dp and tied bytes unhidden
    and Muon's step (its Newton-Schulz FLOPs at `device`'s peak, its tp gathers; module docstring)."""
    def link(ranks: int) -> float:
        return cluster.intra_gbps if ranks <= cluster.gpus_per_node else cluster.inter_gbps

    worst = 0.0
    for r in roles:
        tp_s = sum(size * communication.ring_factor(key.split("/")[1], layout.tp) / (cluster.intra_gbps * 1e9)
                   for key, size in r.trace.collectives.items() if key.startswith("tp/"))
        cp_s = sum(size * communication.ring_factor(key.split("/")[1], layout.cp) / (link(layout.tp * layout.cp) * 1e9)
                   for key, size in r.trace.collectives.items() if key.startswith("cp/"))
        ep = cfg.parallel.ep  # a sparse model's token dispatch, at the link its ep group spans
        cp_s += sum(size * communication.ring_factor(key.split("/")[1], ep) / (link(ep * expert_tp(cfg)) * 1e9)
                    for key, size in r.trace.collectives.items() if key.startswith("ep/"))
        p2p_s = sum(r.trace.boundary.values()) / (link(layout.tp * layout.dp * 2) * 1e9)
        slot = r.trace.roofline_s * layout.accumulation + tp_s + cp_s + p2p_s
        edp = ExpertGroups.of(cfg, tp=layout.tp, cp=layout.cp, dp=layout.dp).expert_dp
        dp_s = sum(size * communication.ring_factor(key.split("/")[1], layout.grad_ranks if key.startswith("dp/") else edp)
                   / (link(layout.tp * layout.grad_ranks) * 1e9)
                   for key, size in r.modelled["collectives"].items() if key.startswith(("dp/", "edp/")))
        muon_s = sum(size * communication.ring_factor(key.split("/")[1], layout.tp) / (cluster.intra_gbps * 1e9)
                     for key, size in r.modelled["collectives"].items() if key.startswith("tp/") and key != "tp/all_gather_into_tensor")
        if device is not None:
            muon_s += r.modelled.get("optimizer_flops", 0.0) / device.peak_flops(layout.precision)
        worst = max(worst, slot / (1 - bubble(layout.pp, layout.accumulation, cfg.parallel.pp_schedule)) + dp_s + muon_s)
    return worst


def dry_run(cfg: Config, *, gpus: int, device: Device, cluster: Cluster | None = None, progress=None) -> DryRun:
    """Trace every distinct role of cfg's layout on `gpus` ranks (module docstring); `progress`
    is called with a line per role traced."""
    start = time.perf_counter()
    layout = layout_of(cfg, gpus)
    cfg = traced_experts(replace(cfg, train=replace(cfg.train, compile=False)))  # traced eager (and experts as on a GPU): what the estimator counts
    cluster = cluster or Cluster(gpus=gpus, memory_gib=device.memory_gib, peak_tflops=device.peak_flops(layout.precision) / 1e12)
    t = cfg.train
    estimates = stage_estimates(cfg, tp=layout.tp, dp=layout.dp, micro_batch=layout.micro_batch, seq_len=layout.seq_len,
                                pp=layout.pp, accumulation=layout.accumulation, cp=layout.cp)
    roles = []
    for stage in range(layout.pp):
        for traced, alike in alike_ranks(cfg, layout.tp, stage == loss_stage(cfg)).items():
            for cp_rank in range(layout.cp):  # each cp rank's chunks see a prefix of their own
                trace = trace_role(cfg, layout, tp_rank=traced, pp_stage=stage, device=device, cp_rank=cp_rank)
                if progress:
                    of_cp = f" (cp rank {cp_rank})" if layout.cp > 1 else ""
                    progress(f"traced tp rank {traced}{of_cp} of stage {stage} ({len(alike)} alike) in {trace.seconds:.1f} s: "
                             f"{trace.parameters / 1e6:.1f}M parameters, peak {trace.peak_bytes / 2**30:.2f} GiB traced")
                roles += [_role(cfg, layout, trace, r, traced, stage, estimates[stage], cp_rank) for r in alike]
    roles.sort(key=lambda r: (r.pp_stage, r.cp_rank, r.tp_rank))
    layout_kw = dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, zero=layout.zero_stage, micro_batch=layout.micro_batch,
                     activation_checkpointing=t.activation_checkpointing,
                     sequence_parallel=cfg.parallel.sequence_parallel and layout.tp > 1,
                     pp_schedule=cfg.parallel.pp_schedule, ep=cfg.parallel.ep, expert_tp=cfg.parallel.expert_tp)
    planned = predict(cfg, cluster, seq_len=layout.seq_len, global_batch=t.global_batch_size, **layout_kw)
    return DryRun(cfg, layout, device, roles, roofline_step(cfg, layout, roles, cluster, device), planned.step_s,
                  time.perf_counter() - start)

