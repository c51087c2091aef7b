"""Micro-batches per data-parallel rank, in an order fixed by (dataset, consumed samples).

The dataset (megatron's GPTDataset / BlendedDataset) is already shuffled by the data seed, so
sample i is the same on every rank and in every run. Step k of the run reads the samples
[c, c + micro * dp) where c is the number consumed so far; data-parallel rank r takes the r-th
block of `micro` of them (Megatron's pretraining sampler). Every tp rank of one dp rank reads the
same samples, and so does every cp rank, keeping its two chunks of each row (parallel.cp:
cplm_dist.model.parallel.context, Megatron's get_batch_on_this_cp_rank). The state a checkpoint stores is that one number, so a resumed run continues with
exactly the next samples: none repeated, none skipped, whatever the prefetching was.
"""

from __future__ import annotations

import functools
import os
from typing import Mapping

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

IGNORE_INDEX = -100  # a label that is not trained on (Megatron's and torch's convention): the loss skips it


def worker_count(configured: int, environ: Mapping[str, str] | None = None) -> int:
    """data.num_workers for this process: under Slurm at most its share of the task's CPUs less one
    (SLURM_CPUS_PER_TASK / CPLM_TASK_PROCS, the processes one task runs: launch/env.sh sizes the
    OpenMP threads from the same share), so that workers never crowd a task of one or two CPUs;
    elsewhere as configured."""
    env = os.environ if environ is None else environ
    try:
        cpus = int(env["SLURM_CPUS_PER_TASK"]) // max(1, int(env.get("CPLM_TASK_PROCS", "1")))
    except (KeyError, ValueError):
        return configured
    return min(configured, max(0, cpus - 1))


class PretrainingBatchSampler(Sampler[list[int]]):
    """Index lists of `micro` samples for one dp rank, from `consumed` to the end of the data."""

    def __init__(self, total: int, consumed: int, micro: int, dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        self.total, self.consumed, self.micro, self.dp_rank, self.dp_size = total, consumed, micro, dp_rank, dp_size

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // (self.micro * self.dp_size))

    def __iter__(self):
        step = self.micro * self.dp_size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.dp_rank * self.micro
            yield list(range(first, first + self.micro))


def resets_positions(dataset) -> bool:
    """Whether megatron's dataset (GPTDataset, or a blend of them) restarts position_ids after each
    end-of-document id: data.document_mask (cplm_dist.data.gpt_data)."""
    return bool(getattr(getattr(dataset, "config", None), "reset_position_ids", False))


def collate(samples: list[dict], positions: bool = False, sources: list[int] | None = None) -> dict[str, torch.Tensor]:
    """GPTDataset samples -> input_ids (B, T) and labels (B, T), -100 where the loss is masked,
    and source (B,): the run's source id of each row's blend entry (megatron's BlendedDataset
    gives its `dataset_id`, a one-entry blend is entry 0; `sources` maps entry -> source id,
    cplm_dist.config.curriculum; default the entry itself); with `positions` (data.document_mask: the
    dataset resets its position_ids after each end-of-document id) also position_ids (B, T)."""
    input_ids = torch.stack([s["tokens"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    loss_mask = torch.stack([s["loss_mask"] for s in samples])
    entries = [int(s.get("dataset_id", 0)) for s in samples]
    source = torch.tensor([sources[e] if sources is not None else e for e in entries], dtype=torch.long)
    batch = {"input_ids": input_ids, "labels": labels.masked_fill(loss_mask == 0, IGNORE_INDEX), "source": source}
    if positions:
        batch["position_ids"] = torch.stack([s["position_ids"] for s in samples])
    return batch


def model_inputs(batch: dict[str, torch.Tensor], device=None) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels[, position_ids]) of a micro-batch, on `device`: the model's arguments,
    and the tuple a pipeline's first stage takes (position_ids travel with ids and labels)."""
    keys = ("input_ids", "labels", "position_ids") if "position_ids" in batch else ("input_ids", "labels")
    return tuple(batch[k] if device is None else batch[k].to(device) for k in keys)


def label_inputs(batch: dict[str, torch.Tensor]):
    """What a pipeline's loss stage takes of a micro-batch: the labels, with the rows' sources
    where the batch has them ((labels, source): the per-source sums, cplm_dist.training.reduction)."""
    return (batch["labels"], batch["source"]) if "source" in batch else batch["labels"]


class ResumableLoader:
    """Iterates micro-batches for this dp rank; `state_dict()` / `load_state_dict()` resume it."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int = 0, consumed_samples: int = 0, pin_memory: bool = False, context=None,
                 sources: list[int] | None = None):
        """context: this rank's ContextShard under parallel.cp > 1 (it keeps its two chunks of each
        row); sources: the dataset's blend entry -> the run's source id (`collate`)."""
        self.dataset, self.micro, self.dp_rank, self.dp_size = dataset, micro_batch_size, dp_rank, dp_size
        self.sources = sources
        self.context = context
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.consumed_samples = consumed_samples
        self._iter = None

    @property
    def samples_per_step(self) -> int:
        return self.micro * self.dp_size

    def __len__(self) -> int:
        """Micro-batches left."""
        return max(0, (len(self.dataset) - self.consumed_samples) // self.samples_per_step)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iter is None:
            sampler = PretrainingBatchSampler(len(self.dataset), self.consumed_samples, self.micro, self.dp_rank, self.dp_size)
            collate_fn = functools.partial(collate, positions=resets_positions(self.dataset), sources=self.sources)
            loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers, collate_fn=collate_fn,
                                pin_memory=self.pin_memory, persistent_workers=False)
            self._iter = iter(loader)
        batch = next(self._iter)
        self.consumed_samples += self.samples_per_step
        if self.context is not None:
            batch = {k: v if k == "source" else self.context.take(v) for k, v in batch.items()}  # rows stay whole
        return batch

    def skip(self, micro_batches: int) -> None:
        """Count `micro_batches` as consumed without reading them (a middle pipeline stage, which
        takes no data, keeps the position the first stage has)."""
        if self._iter is not None:
            raise RuntimeError("skip() is for a loader that is never read")
        self.consumed_samples += micro_batches * self.samples_per_step

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self._iter = None  # restart the worker pipeline at the restored position
