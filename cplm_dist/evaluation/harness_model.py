"""The lm-evaluation-harness model "cplm": a checkpoint behind lm-eval's `LM` interface.

    lm_eval run --model cplm --model_args checkpoint=runs/x --tasks cplm_local --include_path <tasks> --batch_size 16
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/lm_eval_cplm.py --checkpoint runs/x --tasks cplm_local

The stock `lm_eval` finds "cplm" through cplm_dist/evaluation/lm_eval_plugin.py (installed with the
package); `register()` adds it in-process, any number of times.

model_args: checkpoint (required; or pretrained=, lm-eval's usual name), tp (default: the
checkpoint's tp when it divides the launch's world size, else the whole launch; dp = world / tp),
dtype (float32 | bfloat16 | float16), batch_size (or --batch_size, which model_args overrides; "auto" is 16), max_length
(default: model.max_seq_len). The model goes on this rank's GPU (the CPU without one; device=cpu
keeps it there, with gloo). lm-eval's --use_cache is not for tp > 1 (its cache is per global rank).

Data parallel: lm-eval splits the documents over `rank` / `world_size`, which are the dp rank and
size here (the tp ranks of one replica get the same requests and run the model together); the
per-document metrics are gathered to dp rank 0 over the dp group, once.
"""

from __future__ import annotations

import atexit
import hashlib
import sys

import torch
import torch.distributed as dist
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry

from cplm_dist.evaluation.lm_eval_adapter import HarnessAdapter

NAME = "cplm"
AUTO_BATCH = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_batch_size(value) -> int:
    """An lm-eval batch size: an integer, or "auto" / "auto:N" (AUTO_BATCH rows)."""
    text = str(value if value is not None else 1)
    if text.startswith("auto"):
        return AUTO_BATCH
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"batch_size={value!r}: need a positive integer or 'auto'")
    return size


class CPLMHarnessModel(LM):
    def __init__(self, checkpoint: str | None = None, tp: int | str | None = None, dtype: str = "float32",
                 batch_size=1, max_length: int | str | None = None, device: str | None = None,
                 pretrained: str | None = None, seed: int | str | None = None, **_):
        from cplm_dist.checkpoint import load_checkpoint_config, load_model
        from cplm_dist.data.gpt_data import tokenizer_for
        from cplm_dist.distributed import destroy_distributed, evaluation_tp, init_distributed

        super().__init__()
        checkpoint = checkpoint or pretrained  # lm-eval's usual name; it also names --output_path's folder
        if not checkpoint:
            raise ValueError("the cplm model needs --model_args checkpoint=<run directory or step directory>")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        size = parse_batch_size(batch_size)
        _, info = load_checkpoint_config(checkpoint)  # a bad checkpoint: one line before joining a process group
        dims = init_distributed(evaluation_tp(info["layout"]["tp"], None if tp is None else int(tp)),
                                backend="gloo" if str(device) == "cpu" else None)
        self.dims = dims
        self._rank, self._world_size = dims.dp_rank, dims.dp_size
        # lm-eval never tears the process group down: a rank whose gloo threads are still alive
        # when the interpreter finalizes can abort ("terminate called without an active exception")
        atexit.register(destroy_distributed)
        # lm-eval passes device="cuda:0" unless told otherwise: any CUDA device (or none) means this
        # rank's own (its local GPU under torchrun, the CPU on a machine without one); "cpu" is kept
        chosen = torch.device("cpu") if str(device) == "cpu" else None
        model, cfg, _ = load_model(checkpoint, device=chosen, dtype=DTYPES[dtype])
        self.adapter = HarnessAdapter(model, tokenizer_for(cfg), max_length=int(max_length) if max_length else None,
                                      batch_size=size, progress=dims.is_first,
                                      # sampling follows lm-eval's --seed (it seeds torch before building the model)
                                      seed=torch.initial_seed() if seed is None else int(seed))
        self._device = self.adapter.device  # lm-eval's `device`

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """lm-eval passes its --batch_size and --device (defaults included) next to --model_args:
        what --model_args names wins, instead of a duplicate keyword."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def batch_size(self) -> int:
        return self.adapter.batch_size

    @property
    def max_length(self) -> int:
        return self.adapter.max_length

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self.adapter.loglikelihood(self._announce("loglikelihood", requests))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self.adapter.loglikelihood_rolling(self._announce("loglikelihood_rolling", requests))

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self.adapter.generate_until(self._announce("generate_until", requests))

    def _announce(self, kind: str, requests):
        """One line a request type and replica (first tp rank): how lm-eval split the work. The tp
        ranks of a replica run the model together, so they must hold the same requests (lm-eval's
        --use_cache keeps one cache file a global rank: tp peers could find different entries)."""
        if self.dims.tp_size > 1:
            mine = hashlib.sha256(repr([r.args for r in requests]).encode()).hexdigest()
            peers = [None] * self.dims.tp_size
            dist.all_gather_object(peers, mine, group=self.dims.tp_group)
            if len(set(peers)) > 1:
                raise RuntimeError(f"the tp ranks of one replica got different {kind} requests (lm-eval's --use_cache "
                                   "is kept per global rank): run without --use_cache at tp > 1")
        if self.dims.tp_rank == 0:
            print(f"cplm: dp rank {self._rank} of {self._world_size} answers {len(requests)} {kind} requests "
                  f"(batch size {self.adapter.batch_size})", file=sys.stderr, flush=True)
        return requests

    # lm-eval's data parallelism, over the dp group (tp peers hold the same shard of documents)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self._collective_device())
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor, group=self.dims.dp_group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        everything = [None] * self._world_size
        dist.all_gather_object(everything, obj, group=self.dims.dp_group)
        return everything if self._rank == dst else None

    def barrier(self) -> None:
        dist.barrier()

    def _collective_device(self) -> torch.device:
        return self._device if dist.get_backend() == "nccl" else torch.device("cpu")


def register() -> None:
    """Make `--model cplm` available in this process; calling it again changes nothing."""
    import lm_eval.models  # noqa: F401  (lm-eval's own models stay available next to ours)

    if model_registry.get(NAME, None) is not CPLMHarnessModel:
        model_registry.register(NAME, target=CPLMHarnessModel)
