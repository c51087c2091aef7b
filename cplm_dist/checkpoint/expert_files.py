"""A sparse model's experts in its checkpoints, by global expert id, when they are spread over ep > 1
ranks.

DeepSpeed's module states are written by dp rank 0 alone (our saves take its dense path:
cplm_dist.training.expert_groups.saved_as_dense), so at ep > 1 they hold ep rank 0's experts under
local keys and no other ep rank's. Beside them each rank of expert-data-parallel rank 0 (one per
pipeline stage, ep rank and expert-tp rank) writes its own experts into a file of its own,

    experts_pp_{pp:02d}_ep_{ep:02d}_etp_{etp:02d}.pt    {"experts": {global CPLM name: its expert-tp shard},
                                                           "specs": {global CPLM name: [dim, stride, full_rows]},
                                                           "pp_rank", "ep_rank", "ep", "expert_tp_rank", "expert_tp"}

so the files hold every expert once, under the key it has at ep = 1 (cplm_dist.model.moe_naming),
hashed in the manifest like DeepSpeed's files. An ep-1 checkpoint has none: local keys are global
there, and DeepSpeed's module states hold every expert.

    name, state = expert_state(model, dims)    # a save (None: this rank writes no expert file)
    load_own_experts(model, manifest, dims)     # a resume at the saved layout, after DeepSpeed's load
    full = saved_experts(manifest)              # load_model: every expert, joined over expert tp

The optimizer's share of each expert is DeepSpeed's (ZeRO-1/2 partitions, written by every
rank); at ZeRO-0 the optimizer states live in the model states of dp rank 0 only, so a resume of
a ZeRO-0 checkpoint saved at ep > 1 is refused (`check_experts_resumable`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint.manifest import Manifest, check_intact
from cplm_dist.checkpoint.parameter_record import _spec_json, canonical_names, spec_from_json
from cplm_dist.checkpoint.safe_io import safe_load
from cplm_dist.errors import CheckpointError
from cplm_dist.model.moe_naming import expert_of, global_expert_name, with_expert
from cplm_dist.model.parallel.sharding import join_shards, spec_of

EXPERT_FILE = re.compile(r"^experts_pp_(\d+)_ep_(\d+)_etp_(\d+)\.pt$")


def expert_file_name(pp_rank: int, ep_rank: int, expert_tp_rank: int) -> str:
    return f"experts_pp_{pp_rank:02d}_ep_{ep_rank:02d}_etp_{expert_tp_rank:02d}.pt"


def expert_files(manifest: Manifest) -> list[str]:
    """The expert files a checkpoint's manifest lists (none: an ep-1 or dense checkpoint)."""
    return sorted(name for name in manifest.files if EXPERT_FILE.match(name))


def saved_ep(manifest: Manifest) -> int:
    """The ep a checkpoint was saved at (its layout; its config for those saved before the layout had it)."""
    return max(manifest.layout.ep, int((manifest.config.get("parallel") or {}).get("ep") or 1))


def expert_ranks() -> tuple[int, int, int]:
    """(ep rank, expert-tp rank, expert-data-parallel rank) of this rank (megatron's groups)."""
    from cplm_dist.megatron_compat import parallel_state

    edp = parallel_state.get_expert_data_parallel_group()
    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank(),
            dist.get_rank(edp) if edp is not None else 0)


def expert_state(model: torch.nn.Module, dims) -> tuple[str, dict] | None:
    """(file name, state) of this rank's experts for a save at ep > 1, or None where this rank writes
    none (ep = 1, a dense model, an expert-data-parallel rank other than 0)."""
    if dims.ep_size == 1:
        return None
    names = canonical_names(model)
    experts = [(n, p) for n, p in model.named_parameters() if getattr(p, "expert_id", None) is not None]
    if not experts:
        return None
    ep_rank, etp_rank, edp_rank = expert_ranks()
    if edp_rank != 0:
        return None
    keys = {n: global_expert_name(names[n], p) for n, p in experts}
    state = {"experts": {keys[n]: p.detach() for n, p in experts},
             "specs": {keys[n]: _spec_json(spec_of(p)) for n, p in experts},
             "pp_rank": dims.pp_rank, "ep_rank": ep_rank, "ep": dims.ep_size,
             "expert_tp_rank": etp_rank, "expert_tp": dims.expert_tp_size}
    return expert_file_name(dims.pp_rank, ep_rank, etp_rank), state


def write_experts(model: torch.nn.Module, dims, step_dir: Path) -> None:
    """A synchronous save's expert file (on the ranks that write one)."""
    found = expert_state(model, dims)
    if found is not None:
        torch.save(found[1], step_dir / found[0])


def _read(manifest: Manifest, name: str) -> dict:
    try:
        state = safe_load(manifest.step_dir / name, map_location="cpu")
    except FileNotFoundError:
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("experts"), dict):
        raise CheckpointError(f"{manifest.step_dir / name} is not an expert file of cplm-train: use an earlier step "
                              "(--checkpoint <run>/checkpoints/step-*)")
    return state


def check_expert_files(manifest: Manifest, hashed: bool = True) -> list[str]:
    """The expert files of a checkpoint saved at ep > 1: one line where it has none (saved before
    they were written) or, `hashed`, where one is missing or damaged (sizes and sha256 against its
    manifest; a resume has hashed every file already: Checkpointer.newest_intact)."""
    names = expert_files(manifest)
    if saved_ep(manifest) > 1 and not names:
        raise CheckpointError(f"{manifest.step_dir} was saved at parallel.ep={saved_ep(manifest)} without its expert "
                              "files (experts_pp_*_ep_*_etp_*.pt, before cplm_dist wrote them): it holds ep rank 0's "
                              "experts only; use a checkpoint saved since")
    if hashed:
        check_intact(manifest, names)
    return names


def load_own_experts(model: torch.nn.Module, manifest: Manifest, dims) -> None:
    """After DeepSpeed's load of a checkpoint saved at this layout: this rank's experts from the
    expert file of its pipeline stage, ep rank and expert-tp rank (DeepSpeed's module states gave
    every rank ep rank 0's). Nothing to do for an ep-1 checkpoint."""
    if dims.ep_size == 1 or not any(getattr(p, "expert_id", None) is not None for p in model.parameters()):
        return
    check_expert_files(manifest, hashed=False)
    ep_rank, etp_rank, _ = expert_ranks()
    name = expert_file_name(dims.pp_rank, ep_rank, etp_rank)
    if name not in manifest.files:
        raise CheckpointError(f"{manifest.step_dir}: no {name} in its manifest (saved at another layout): resume at the "
                              "layout it was saved with")
    saved = _read(manifest, name)["experts"]
    names = canonical_names(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if getattr(p, "expert_id", None) is None:
                continue
            key = global_expert_name(names[n], p)
            if key not in saved or saved[key].shape != p.shape:
                raise CheckpointError(f"{manifest.step_dir / name}: no expert weight {key} of shape {tuple(p.shape)}: "
                                      "resume at the layout it was saved with")
            p.copy_(saved[key])


def saved_experts(manifest: Manifest) -> dict[str, torch.Tensor]:
    """{global CPLM name: the whole expert weight} of every expert of a checkpoint saved at ep > 1
    (each joined over the expert-tp ranks that held its shards); {} for one saved at ep = 1."""
    names = check_expert_files(manifest)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    specs: dict[str, list] = {}
    for name in names:
        state = _read(manifest, name)
        for key, tensor in state["experts"].items():
            shards.setdefault(key, {})[int(state["expert_tp_rank"])] = tensor
            specs[key] = state["specs"][key]
    return {key: join_shards([parts[r] for r in sorted(parts)], spec_from_json(specs[key]))
            for key, parts in shards.items()}


def with_saved_experts(full: dict[str, torch.Tensor], experts: dict[str, torch.Tensor],
                       model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`full` (tp-independent weights from DeepSpeed's module states, for `model`'s names) with
    every expert entry replaced by the expert file's weight for the expert `model`'s parameter
    holds (its `expert_id`), under the parameter's global name (at ep = 1 the local key is the
    global one). `experts` empty: `full`."""
    if not experts:
        return full
    out = {k: v for k, v in full.items() if expert_of(k) is None}
    names = canonical_names(model)
    for n, p in model.named_parameters():
        expert = getattr(p, "expert_id", None)
        if expert is not None and (key := with_expert(names[n], expert)) in experts:
            out[global_expert_name(n, p)] = experts[key]  # load_full_state_dict reads experts by global id
    return out
