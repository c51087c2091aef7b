"""AdamW (or Muon beside it: optim.name) with parameter groups, the learning-rate schedules, and
the non-finite guard.

Parameter groups: vectors (norm weights, biases) never get weight decay; embeddings (the input
embedding, and the LM head tied to it or not) only when `optim.decay_embeddings` is set; the
parameters `optim.no_decay` names by prefix (e.g. the copy head's) never. Schedules (per optimizer step):

| optim.schedule | shape |
|---|---|
| cosine   | linear warmup to lr, cosine decay to min_lr at train_steps |
| wsd      | warmup-stable-decay: linear warmup, constant lr, then linear decay to min_lr over the last decay_fraction of the steps |
| constant | linear warmup, then lr |

`GuardedAdamW` skips the update when any gradient it would apply is non-finite on any rank, and
says so (`skipped_last`). DeepSpeed's own overflow skipping exists for some ZeRO stages and
precisions only (not ZeRO-3 in fp32/bf16, not stage 0 in fp32); this check makes every stage
behave alike. Inside a ZeRO wrapper it sees that rank's partition of the fp32 gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cplm_dist.config import Config
from cplm_dist.errors import UsageError
from cplm_dist.megatron_compat import parallel_state
from cplm_dist.training.expert_groups import is_expert, with_expert_groups
from cplm_dist.training.muon import Orthogonaliser, mark_matrices


def parameter_groups(model: torch.nn.Module, cfg: Config) -> list[dict]:
    """Weight decay for matrices, not for norms, biases and (unless optim.decay_embeddings) the
    vocabulary tensors; by the parameters' CPLM names (a pipeline stage maps its own to them).
    optim.name=muon puts the transformer layers' matrices first, in a group of their own marked
    `orthogonal` (cplm_dist.training.muon), with optim.muon.lr."""
    decay, no_decay = [], []
    named = list(model.canonical_named_parameters() if hasattr(model, "canonical_named_parameters")
                 else model.named_parameters())
    muon = mark_matrices(named, cfg) if cfg.optim.name == "muon" else []
    orthogonal = {id(p) for p in muon}
    undecayed = undecayed_names([name for name, _ in named], [name for name, p in named if id(p) in orthogonal], cfg,
                                whole=not hasattr(model, "canonical_named_parameters"))
    for name, param in named:
        if not param.requires_grad or id(param) in orthogonal:
            continue
        is_embedding = name.startswith(("embedding.", "lm_head."))
        if param.ndim < 2 or (is_embedding and not cfg.optim.decay_embeddings) or name in undecayed:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    if not muon:
        return groups
    # Muon beside one AdamW group: DeepSpeed drops empty groups and reduces the gradient norm group
    # by group over the pipeline, so every stage must hold the same groups (a first stage has no
    # decayed AdamW matrix). The decayed members carry `_cplm_decay` and are decayed before
    # AdamW's step exactly as AdamW's decoupled decay would (GuardedMuon.decay_marked).
    for param in decay:
        param._cplm_decay = True
    m = cfg.optim.muon
    return [{"params": muon, "weight_decay": cfg.optim.weight_decay, "name": "muon", "orthogonal": True,
             "lr": cfg.optim.lr if m.lr is None else m.lr, "momentum": m.momentum, "nesterov": m.nesterov},
            {"params": decay + no_decay, "weight_decay": 0.0, "decoupled_decay": cfg.optim.weight_decay, "name": "adamw"}]


def undecayed_names(names: list[str], orthogonal: list[str], cfg: Config, whole: bool = True) -> set[str]:
    """The parameters `optim.no_decay` names by prefix. A prefix that names no parameter of the
    whole model (a typo, or a part this model lacks: copy_head. with the copy head off; a pipeline
    stage, `whole` false, need not hold every part), or one that names a Muon
    matrix (decayed by Muon's own group: optim.muon.copy_head=false keeps the copy head in AdamW), is
    a usage error."""
    out = set()
    for prefix in cfg.optim.no_decay:
        named = {n for n in names if n.startswith(prefix)}
        if not named and whole:
            raise UsageError(f"optim.no_decay: {prefix!r} names no parameter of this model "
                             f"(names begin {sorted({n.split('.')[0] + '.' for n in names})}); fix the prefix")
        if any(n.startswith(prefix) for n in orthogonal):
            raise UsageError(f"optim.no_decay: {prefix!r} names Muon matrices, which Muon decays in its own group; "
                             "set optim.muon.copy_head=false or leave the prefix out")
        out |= named
    return out


def lr_factor(step: int, cfg: Config) -> float:
    """Multiplier of optim.lr after `step` optimizer steps (LambdaLR convention)."""
    o, total = cfg.optim, cfg.train.train_steps
    floor = o.min_lr / o.lr
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "cosine":
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total - int(round(o.decay_fraction * total))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
    return 1.0 - (1 - floor) * progress


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that leaves the parameters untouched when a gradient is non-finite on any rank."""

    def __init__(self, params, group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.group = group
        self.skipped_last = False
        self.before_step = None  # a callable run first in each step (pipeline ZeRO-0: the norm and clipping)
        # a callable every rank runs after the guard, True to skip this update too (train.skip_spikes:
        # cplm_dist.training.stability); `skipped_spike` says it did
        self.skip_check = None
        self.skipped_spike = False

    @torch.no_grad()
    def all_grads_finite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        ok = torch.tensor(1.0)
        if grads:
            ok = torch.isfinite(torch.stack(torch._foreach_norm(grads)).float().sum()).float().cpu()
        if dist.is_initialized():
            device = grads[0].device if grads else ok.device
            ok = ok.to(device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        return bool(ok.item() > 0)

    @property
    def overflow(self) -> bool:  # DeepSpeed's stage-0 engine reads this to count a skipped step
        return self.skipped_last or self.skipped_spike

    def step(self, closure=None):
        if self.before_step is not None:
            self.before_step()
        self.skipped_last = not self.all_grads_finite()
        self.skipped_spike = self.skip_check is not None and bool(self.skip_check())  # collective: always asked
        if self.skipped_last or self.skipped_spike:
            return None
        return self.apply_step(closure)

    def apply_step(self, closure=None):
        """The update itself, once the guard has passed (GuardedMuon: Muon's groups, then AdamW's)."""
        return torch.optim.AdamW.step(self, closure)


def adamw_kernels(impl: str, device: torch.device) -> dict:
    """optim.impl -> AdamW's keyword: auto is fused on CUDA (one kernel per step over all
    tensors) and foreach on CPU (where fused exists too but the CPU figures were measured with foreach)."""
    fused = impl == "fused" or (impl == "auto" and device.type == "cuda")
    return {"fused": True} if fused else {"foreach": True}


class GuardedMuon(GuardedAdamW):
    """Muon for the parameter groups marked `orthogonal` (cplm_dist.training.muon.Orthogonaliser),
    AdamW (the parent) for the others: one optimizer for DeepSpeed to step and save, the
    non-finite guard over both, the raw gradient's norm and clipping left to DeepSpeed."""

    def __init__(self, params, orthogonaliser: Orthogonaliser, group: dist.ProcessGroup | None = None, **kwargs):
        super().__init__(params, group=group, **kwargs)
        self.orthogonaliser = orthogonaliser

    def apply_step(self, closure=None):
        groups = self.param_groups  # DeepSpeed's ZeRO steps one group at a time, swapping this list
        for group in groups:
            if group.get("orthogonal"):
                self.orthogonaliser.step_group(self.state, group)
        rest = [g for g in groups if not g.get("orthogonal")]
        if rest:
            self.decay_marked(rest)
            self.param_groups = rest
            try:
                torch.optim.AdamW.step(self)
            finally:
                self.param_groups = groups
        return None

    @torch.no_grad()
    def decay_marked(self, groups: list[dict]) -> None:
        """AdamW's decoupled decay, p <- p (1 - lr wd), for the members marked `_cplm_decay` (a
        module's parameter, or their slices of a ZeRO flat partition: `_cplm_decay_slices`)."""
        for group in groups:
            decay = group.get("decoupled_decay", 0.0)
            if not decay:
                continue
            factor = 1 - group["lr"] * decay
            for param in group["params"]:
                if param.grad is None:
                    continue
                slices = getattr(param, "_cplm_decay_slices", None)
                if slices is None:
                    if getattr(param, "_cplm_decay", False):
                        param.mul_(factor)
                    continue
                for piece in slices:
                    param[piece].mul_(factor)


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """optim.muon.ns_dtype -> the Newton-Schulz iteration's dtype: auto is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_optimizer(model: torch.nn.Module, cfg: Config, tp_group: dist.ProcessGroup | None = None,
                    experts: str | None = None) -> GuardedAdamW:
    """Our optimizer over `parameter_groups`; a sparse model's experts in groups of their own marked
    for DeepSpeed (`experts`: their group name, cplm_dist.training.expert_groups)."""
    o = cfg.optim
    device = next(model.parameters()).device
    adamw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **adamw_kernels(o.impl, device))
    if o.name == "muon":
        m = o.muon
        orthogonaliser = Orthogonaliser(tp_group, ns_steps=m.ns_steps, ns_dtype=ns_dtype(m.ns_dtype, device),
                                        rms_scale=m.rms_scale)
        return GuardedMuon(with_expert_groups(parameter_groups(model, cfg), experts), orthogonaliser, **adamw)
    return GuardedAdamW(with_expert_groups(parameter_groups(model, cfg), experts), **adamw)


@torch.no_grad()
def grad_norm(model: torch.nn.Module, tp_group: dist.ProcessGroup | None,
              pp_group: dist.ProcessGroup | None = None) -> float:
    """Global L2 norm of the gradients held in `model` (ZeRO stage 0, where DeepSpeed reports
    none): split parameters count on every tp rank, replicated ones once; experts (a sparse model,
    their gradients already reduced over their expert-dp group) summed over the ranks holding
    different experts or different shards of one (megatron's expert-tp x ep group), so each once;
    with pipeline stages (`pp_group`) every stage's part, the tied embedding's second copy not counted."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    dense, experts = [], []
    for p in model.parameters():
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if is_expert(p):
            experts.append(p.grad.float().pow(2).sum())
        elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            dense.append(p.grad.float().pow(2).sum())
    # a rank holding no counted gradient still joins the all-reduce, with a zero on the model's
    # device (NCCL reduces device tensors only)
    device = next(model.parameters()).device
    total = torch.stack(dense).sum() if dense else torch.zeros((), device=device)
    _sum_over(total, tp_group)
    if experts:  # the ranks of one stage (its expert group) all hold sparse layers, or none
        expert_total = torch.stack(experts).sum()
        _sum_over(expert_total, parallel_state.get_expert_tensor_and_model_parallel_group())
        total = total + expert_total
    _sum_over(total, pp_group)
    return float(total.sqrt())


def _sum_over(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


@torch.no_grad()
def parameters_finite(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """Every parameter finite on every rank of `group` (ZeRO-3: each rank checks its partition)."""
    tensors = [getattr(p, "ds_tensor", p) for p in model.parameters()]
    tensors = [t for t in tensors if t.numel()]
    ok = torch.tensor(1.0)
    if tensors:
        ok = torch.isfinite(torch.stack(torch._foreach_norm([t.float() for t in tensors])).sum()).float().cpu()
    if dist.is_initialized():
        ok = ok.to(tensors[0].device if tensors else ok.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item() > 0)
