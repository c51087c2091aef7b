"""AdamW with parameter groups, the learning-rate schedules, and the non-finite guard.

Parameter groups: vectors (norm weights, biases) never get weight decay; embeddings (the input
embedding, and the LM head tied to it or not) only when `optim.decay_embeddings` is set. Schedules (per optimizer step):

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


def parameter_groups(model: torch.nn.Module, cfg: Config) -> list[dict]:
    """Weight decay for matrices, not for norms, biases and (unless optim.decay_embeddings) the
    vocabulary tensors; by the parameters' CPLM names (a pipeline stage maps its own to them)."""
    decay, no_decay = [], []
    named = model.canonical_named_parameters() if hasattr(model, "canonical_named_parameters") else model.named_parameters()
    for name, param in named:
        if not param.requires_grad:
            continue
        is_embedding = name.startswith(("embedding.", "lm_head."))
        if param.ndim < 2 or (is_embedding and not cfg.optim.decay_embeddings):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": cfg.optim.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


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
        return self.skipped_last

    def step(self, closure=None):
        if self.before_step is not None:
            self.before_step()
        self.skipped_last = not self.all_grads_finite()
        if self.skipped_last:
            return None
        return super().step(closure)


def adamw_kernels(impl: str, device: torch.device) -> dict:
    """optim.impl -> AdamW's keyword: auto is fused on CUDA (one kernel per step over all
    tensors) and foreach on CPU (where fused exists too but the CPU figures were measured with foreach)."""
    fused = impl == "fused" or (impl == "auto" and device.type == "cuda")
    return {"fused": True} if fused else {"foreach": True}


def build_optimizer(model: torch.nn.Module, cfg: Config) -> GuardedAdamW:
    o = cfg.optim
    device = next(model.parameters()).device
    return GuardedAdamW(parameter_groups(model, cfg), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                        weight_decay=o.weight_decay, **adamw_kernels(o.impl, device))


@torch.no_grad()
def grad_norm(model: torch.nn.Module, tp_group: dist.ProcessGroup | None,
              pp_group: dist.ProcessGroup | None = None) -> float:
    """Global L2 norm of the gradients held in `model` (ZeRO stage 0, where DeepSpeed reports
    none): split parameters count on every tp rank, replicated ones once; with pipeline stages
    (`pp_group`) every stage's part, the tied embedding's second copy not counted."""
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    squares = [p.grad.float().pow(2).sum() for p in model.parameters()
               if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
               and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
    # a rank holding no counted gradient still joins the all-reduce, with a zero on the model's
    # device (NCCL reduces device tensors only)
    device = next(model.parameters()).device
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    for group in (tp_group, pp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return float(total.sqrt())


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
