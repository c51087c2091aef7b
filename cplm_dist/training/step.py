"""One optimizer step: the function training runs and the profiler measures, so that the
profiler cannot time something training does not do; and how both build it.

    step = build_train_step(cfg, dims, device)   # the model (build_training_model), DeepSpeed's engine, the step
    result = step(batches)            # next(batches) -> {"input_ids": (micro, T), "labels": (micro, T)}

A step reads `accumulation` micro-batches. Each micro-batch's loss is its summed per-token loss
over its trained tokens (labels != -100); DeepSpeed averages the micro-batches and the dp ranks.
Under context parallelism a rank's loss is its own tokens' share of the sequence's mean (the
token count summed over cp), and DeepSpeed sums the gradients over cp (cplm_dist.training.engine).
The figures returned (loss, the LM head's own loss, the copy share) are the batch's, the same on
every rank: cplm_dist.training.reduction adds the micro-batches and reduces them over dp x cp,
as it does for validation and evaluation. `phases` (a dict) adds forward, backward and
optimizer seconds to it, synchronising the device between them (the profiler's breakdown steps;
a clean step passes none and is not synchronised inside).

At parallel.pp > 1 DeepSpeed's pipeline engine runs the step's micro-batches through the 1F1B
schedule itself (`train_batch`): the first and last stage read the micro-batches (ids and labels
enter at the first, labels are counted at the last), the middle stages only count them. The last
stage's loss function adds each micro-batch to the same sums (cplm_dist.training.pipeline),
which are reduced the same way and sent to every stage. Its phases are one ("pipeline"): forward
and backward interleave.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from cplm_dist.config import Config
from cplm_dist.config.curriculum import source_names
from cplm_dist.data.loader import label_inputs, model_inputs
from cplm_dist.distributed import ParallelDims, synchronize
from cplm_dist.megatron_compat import parallel_state
from cplm_dist.model.cplm import build_model
from cplm_dist.model.moe import set_aux_loss_scale, sparse_layers, update_expert_bias
from cplm_dist.model.moe_stats import step_figures
from cplm_dist.model.parallel.stages import loss_stage
from cplm_dist.training.engine import build_engine
from cplm_dist.training.optim import grad_norm
from cplm_dist.training.pipeline import build_pipeline_model
from cplm_dist.training.reduction import BatchSums, ReduceGroups, injected
from cplm_dist.training.stability import SpikeMonitor


@dataclass
class StepResult:
    loss: float  # mean per-token loss of the mixture over the step's micro-batches and dp ranks
    lm_loss: float  # the LM head alone on the same tokens
    copy_share: float  # mean share of the next-token mass the copy side holds
    grad_norm: float  # global gradient norm before clipping (nan where unknown)
    lr: float  # the learning rate this step used
    skipped: bool  # the optimizer skipped the update (a non-finite gradient on some rank)
    data_wait_s: float = 0.0  # this rank's time blocked on its micro-batches (not synchronised: shows stragglers)
    # per source: summed nll, LM-only nll, copy share, trained tokens over dp x cp (BatchFigures.source_sums)
    source_sums: tuple[float, ...] = ()
    spikes: tuple = ()  # the step's loss / grad-norm spikes (cplm_dist.training.stability.Spike)
    spike_skipped: bool = False  # train.skip_spikes skipped this update (its loss spiked)
    moe: dict = field(default_factory=dict)  # a sparse model's figures this step (cplm_dist.model.moe_stats.step_figures)

    @property
    def bad(self) -> bool:
        return self.skipped or not math.isfinite(self.loss) or not math.isfinite(self.grad_norm)


@contextlib.contextmanager
def _phase(phases: dict | None, name: str, device: torch.device):
    if phases is None:
        yield
        return
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


class TrainStep:
    def __init__(self, engine, optimizer, scheduler, dims: ParallelDims, cfg: Config):
        self.engine, self.optimizer, self.scheduler, self.dims = engine, optimizer, scheduler, dims
        self.accumulation = engine.gradient_accumulation_steps()
        self.zero_stage = cfg.train.zero_stage
        self.device = engine.device
        self.groups = ReduceGroups.of(dims, loss_stage(cfg))
        # the pipeline's last stage adds to its module's sums inside DeepSpeed's schedule
        self.sums = engine.module.sums if dims.pp_size > 1 else BatchSums(self.device, len(source_names(cfg)))
        self.monitor = SpikeMonitor(cfg.train)
        self._figures = None  # the batch's figures, when the spike check reduced them before the update
        self.last_batch = None  # the last micro-batch read (pp = 1): train.diagnostics_interval measures it
        if self.monitor.skip:
            optimizer.skip_check = self._loss_spikes
        self.sparse = sparse_layers(engine.module)  # a sparse model's MoE layers on this rank (cplm_dist.model.moe)
        if self.sparse:
            set_aux_loss_scale(self.accumulation, self.device)
            self.stage_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)

    def _loss_spikes(self) -> bool:
        """In the optimizer step, on every rank: the batch's loss (reduced now, kept for the result) spikes."""
        self._figures = self.groups.reduce(self.sums)
        return self.monitor.skips(self._figures.loss)

    def _follow_schedule(self, skipped_before: int, schedule_before: int) -> None:
        """A skipped update still uses up its step of the learning-rate schedule, at every ZeRO stage
        and whoever skipped it, so a step's rate is the schedule's at that step. DeepSpeed steps the
        schedule only when the optimizer it holds reports no overflow: our guard at ZeRO-0, its
        partitioned optimizer at ZeRO-1/2 (which finds a non-finite gradient itself, and never sees a
        loss spike's skip), no check at ZeRO-3; so a skip left the schedule behind at some stages only."""
        guarded = self.optimizer.skipped_last or self.optimizer.skipped_spike
        if (guarded or self.engine.skipped_steps > skipped_before) and self.scheduler.last_epoch == schedule_before:
            self.scheduler.step()

    def _result(self, figures, norm, lr: float, skipped_before: int, data_wait: float) -> StepResult:
        """The step's result, its spikes observed (the monitor's windows advance)."""
        norm = float(norm) if norm is not None else float("nan")
        spiked = self.optimizer.skipped_spike
        skipped = self.optimizer.skipped_last or (self.engine.skipped_steps > skipped_before and not spiked)
        moe = {}
        if self.sparse:  # after every micro-batch: the expert bias moves once, the step's routing is reported
            update_expert_bias(self.engine.module)
            moe = step_figures(self.sparse, self.stage_group)
        result = StepResult(figures.loss, figures.lm_loss, figures.copy_share, norm, lr, skipped, data_wait,
                            figures.source_sums, spike_skipped=spiked, moe=moe)
        result.spikes = tuple(self.monitor.observe(result.loss, norm, result.bad))
        self.monitor.skipped_updates += int(spiked and not result.bad)  # a non-finite step is counted as that alone
        return result

    def __call__(self, batches: Iterator[dict], *, inject_nonfinite: bool = False, inject_scale: float = 1.0,
                 phases: dict | None = None) -> StepResult:
        """inject_nonfinite / inject_scale: fault injection (train.inject_nonfinite_at, train.inject_spike_at):
        the step's loss made NaN / multiplied by inject_scale, its gradients with it."""
        if self.dims.pp_size > 1:
            return self._pipeline_step(batches, inject_nonfinite, inject_scale, phases)
        engine, device = self.engine, self.device
        sums = self.sums.zero_()
        self._figures = None
        skipped_before, schedule_before = engine.skipped_steps, self.scheduler.last_epoch
        norm = None
        lr = self.scheduler.get_last_lr()[0]  # this step's rate: engine.step() advances the schedule
        data_wait = 0.0
        for _ in range(self.accumulation):
            waited = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - waited
            source = batch.get("source")  # the rows' source ids (per-source sums)
            self.last_batch = batch
            inputs = model_inputs(batch, device)  # ids, labels (and position_ids: data.document_mask)
            labels = inputs[1]
            with _phase(phases, "forward", device):
                out = engine(*inputs)
                nll = injected(out.nll, inject_nonfinite, inject_scale)
                loss = sums.add(nll, out.lm_nll, out.copy_share, labels, self.groups.sequence_tokens(labels), source)
            with _phase(phases, "backward", device):
                engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                self.optimizer.skipped_last = self.optimizer.skipped_spike = False
                if self.zero_stage == 0 and self.optimizer.before_step is None:  # DeepSpeed reports no norm at stage 0
                    norm = grad_norm(engine.module, self.dims.tp_group)
            with _phase(phases, "optimizer", device):
                engine.step()
        figures = self._figures or self.groups.reduce(sums)
        if norm is None:  # ZeRO-0 clipped by our optimizer (engine.clips_itself) kept its norm; ZeRO-1/2: DeepSpeed's
            norm = getattr(self.optimizer, "grad_norm", None) if self.zero_stage == 0 else engine.get_global_grad_norm()
        self._follow_schedule(skipped_before, schedule_before)
        return self._result(figures, norm, lr, skipped_before, data_wait)

    def _pipeline_step(self, batches, inject_nonfinite: bool, inject_scale: float, phases: dict | None) -> StepResult:
        engine = self.engine
        lr = self.scheduler.get_last_lr()[0]
        skipped_before, schedule_before = engine.skipped_steps, self.scheduler.last_epoch
        self.optimizer.skipped_last = self.optimizer.skipped_spike = False
        engine.module.inject_nonfinite, engine.module.inject_scale = inject_nonfinite, inject_scale
        self.sums.zero_()
        self._figures = None
        wait = [0.0]

        def micro_batches():
            while True:
                waited = time.perf_counter()
                batch = next(batches)
                wait[0] += time.perf_counter() - waited
                yield model_inputs(batch), label_inputs(batch)  # position_ids (data.document_mask) carried like ids

        reads = engine.is_first_stage() or engine.is_last_stage()  # DeepSpeed's rule: they load micro-batches
        with _phase(phases, "pipeline", self.device):
            engine.train_batch(data_iter=micro_batches() if reads else None)
        if not reads and hasattr(batches, "skip"):  # the position a checkpoint stores: what the other stages read
            batches.skip(self.accumulation)
        figures = self._figures or self.groups.reduce(self.sums)  # the last stage's sums, over dp x cp, then to every stage
        norm = getattr(self.optimizer, "grad_norm", None) if self.zero_stage == 0 else engine.get_global_grad_norm()
        self._follow_schedule(skipped_before, schedule_before)
        return self._result(figures, norm, lr, skipped_before, wait[0])


def build_training_model(cfg: Config, dims: ParallelDims, device: torch.device) -> torch.nn.Module:
    """The module a run hands DeepSpeed: this rank's pipeline stage at parallel.pp > 1 (a
    PipelineModule), else the whole CPLM; activation checkpointing and compile as cfg.train says
    (cplm_dist.model.recompute_compile)."""
    if dims.pp_size > 1:
        return build_pipeline_model(cfg, dims, device=device)
    return build_model(cfg, tp_group=dims.tp_group, device=device)


def build_train_step(cfg: Config, dims: ParallelDims, device: torch.device, model: torch.nn.Module | None = None, *,
                     load_universal: bool = False) -> TrainStep:
    """Training's step for `model` (default: `build_training_model`'s, from cfg.seed): DeepSpeed's
    engine with our optimizer and schedule around it. cplm-train and the profiler both build it
    here. `load_universal`: the engine will resume from a universal checkpoint (a reshape)."""
    if model is None:
        torch.manual_seed(cfg.seed)
        model = build_training_model(cfg, dims, device)
    engine, optimizer, scheduler = build_engine(model, cfg, dims, load_universal=load_universal)
    return TrainStep(engine, optimizer, scheduler, dims, cfg)
