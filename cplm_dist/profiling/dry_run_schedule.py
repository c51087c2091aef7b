"""How the dry run (cplm_dist.profiling.dry_run) runs one role's micro-batches: the inputs a stage
receives, its forwards and backwards in the order its pipeline schedule holds them, and the bytes
its boundary tensors put on the pipeline's links.

    schedule = RoleSchedule(module, cfg, layout, stage, device, context)
    schedule.run(); schedule.boundary, schedule.micro_batches

pp = 1: min(accumulation, 2) micro-batches, each forward then backward. 1F1B: min(p - s,
accumulation) forwards held, one backward, one more forward, the rest of the backwards. DualPipeV
(stage.chunks == 2, a DualPipeVModule): each micro-batch through the rank's stage r (phase 0) and
its stage 2p - 1 - r (phase 1; on the last rank fed by phase 0's output, elsewhere a fake received
activation), p micro-batches and a half (one more through phase 0) held, as memory.in_flight.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from cplm_dist.config import Config
from cplm_dist.profiling.memory import in_flight


def _micro_batch(cfg: Config, layout, receives: bool, device, context=None):
    """(a stage's inputs, labels, the received hidden states or None) of one micro-batch: ids and
    labels (B, T), or this cp rank's two chunks (B, T/cp) under context parallelism (`context`, its
    ContextShard); where the stage `receives` its input also the hidden states, (B, T/cp, D) or
    sequence-first (T/cp/tp, B, D) under sequence parallelism, to be differentiated."""
    B, T, D = layout.micro_batch, layout.seq_len, cfg.model.hidden_size
    local = T // layout.cp
    ids = torch.randint(0, cfg.model.vocab_size, (B, local), device=device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    # data.document_mask: the positions travel with ids and labels (one document a row: the mask's shape is what costs)
    whole = torch.arange(T, device=device).expand(B, T)
    positions = ((whole if context is None else context.take(whole)),) if cfg.data.document_mask else ()
    if not receives:
        return (ids, labels, *positions), labels, None
    sp = cfg.parallel.sequence_parallel and layout.tp > 1
    shape = (local // layout.tp, B, D) if sp else (B, local, D)  # this rank's positions (its cp chunks)
    x = torch.randn(shape, dtype=torch.bfloat16 if layout.precision == "bf16" else torch.float32,
                    device=device, requires_grad=True)
    return (x, ids, labels, *positions), labels, x


def _ids_bytes(ids: torch.Tensor) -> float:
    return 2 * ids.numel() * ids.element_size()  # the ids and the labels


class RoleSchedule:
    """Runs one role's micro-batches (module docstring) and counts the pipeline boundary."""

    def __init__(self, module, cfg: Config, layout, stage, device, context=None):
        self.module, self.cfg, self.layout, self.stage, self.device = module, cfg, layout, stage, device
        self.context = context
        self.pending: list = []
        self.boundary = defaultdict(float)
        self.micro_batches = 0
        self.dual = stage is not None and stage.chunks == 2
        self.counted: dict | None = None  # the collective counter's by_name (CommTimer), to leave the half out of

    def sent(self, t: torch.Tensor) -> float:
        """What the pipeline engine sends of a hidden-state tensor: under 1F1B at tp > 1 a 1/tp
        partition of it (DualPipeV sends it whole), under sequence parallelism the shard it is."""
        partitioned = self.layout.tp > 1 and not self.cfg.parallel.sequence_parallel and not self.dual
        return t.numel() * t.element_size() / (self.layout.tp if partitioned else 1)

    def _received(self, inputs, x) -> None:
        self.boundary["pp/recv"] += self.sent(x) + _ids_bytes(inputs[-2])
        self.boundary["pp/send"] += self.sent(x)  # its gradient, back

    def _sends(self, out, inputs) -> None:
        self.pending.append((out[0], torch.randn_like(out[0])))  # the gradient the next stage sends back
        self.boundary["pp/send"] += self.sent(out[0]) + _ids_bytes(inputs[-2])
        self.boundary["pp/recv"] += self.sent(out[0])

    def forward(self):
        stage = self.stage
        inputs, labels, x = _micro_batch(self.cfg, self.layout, stage is not None and not stage.first, self.device,
                                         self.context)
        out = self.module(*inputs) if stage is None else self.module(inputs)
        if stage is None:
            self.pending.append((out.nll.sum() / (labels != -100).sum(), None))
        elif stage.last:
            self.pending.append((self.module.loss_fn(out, labels), None))
        else:
            self._sends(out, inputs)
        if x is not None:
            self._received(inputs, x)
        self.micro_batches += 1

    def forward_dual(self, phases: tuple[int, ...] = (0, 1)):
        """One micro-batch through this rank's DualPipeV stages: phase 0 out, phase 1 back (the last
        rank turns it around: its phase 1 runs on phase 0's output, one backward through both)."""
        stage, module = self.stage, self.module
        turns, out = stage.index == stage.stages - 1, None
        for phase in phases:
            module.activate_phase(phase)
            if phase == 0 or not turns:
                inputs, labels, x = _micro_batch(self.cfg, self.layout, not (phase == 0 and stage.first), self.device,
                                                 self.context)
            else:
                inputs, x = out, None  # phase 0's output, on this rank
                self.pending.pop()  # its backward runs through phase 1's
            out = module(inputs)
            if phase == 1 and stage.last:
                self.pending.append((module.loss_fn(out, labels), None))
            elif phase == 0 and turns:
                self.pending.append((out[0], torch.randn_like(out[0])))  # phase 1's replaces it, if it runs
            else:
                self._sends(out, inputs)
            if x is not None:
                self._received(inputs, x)
        module.activate_phase(0)

    def backward(self, last: bool = False):
        value, grad = self.pending.pop(-1 if last else 0)
        torch.autograd.backward(value, grad)

    def _uncounted_half(self):
        """DualPipeV's extra phase-0 micro-batch, forward and backward at the peak of what the rank
        holds; its collectives and boundary bytes left out of the counts (they are per whole
        micro-batch through both stages)."""
        collectives = None if self.counted is None else {k: list(v) for k, v in self.counted.items()}
        boundary = dict(self.boundary)
        self.forward_dual((0,))
        self.backward(last=True)
        if collectives is not None:
            self.counted.clear()
            self.counted.update(collectives)
        self.boundary.clear()
        self.boundary.update(boundary)

    def run(self):
        acc = self.layout.accumulation
        if self.stage is None or self.stage.stages == 1:
            for _ in range(min(acc, 2)):
                self.forward()
                self.backward()
            return
        held = in_flight(self.stage, acc)
        if self.dual:  # p micro-batches through both stages, and one more through the first
            for _ in range(int(held)):
                self.forward_dual()
                self.micro_batches += 1
            if held > int(held):
                self._uncounted_half()
        else:
            for _ in range(held):
                self.forward()
            self.backward()
            if acc > held:
                self.forward()
        while self.pending:
            self.backward()
