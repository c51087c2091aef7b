"""Checkpoints: the format, saving and resuming a run, reshaping it to another layout, and loading
it for evaluation.

    manifest.py  names and resolution (run / checkpoints / step dir; a run's final checkpoint),
                 complete.json (format 2, the typed `Manifest`, read once per resume; format 1
                 upgraded), the layout rules, what a resume may change, the tokenizer files a
                 checkpoint carries
    safe_io.py   DeepSpeed's file names, weights-only loading, a failed write's reason, two checkpoints'
                 weights compared bit for bit
    saver.py     `Checkpointer` (save, resume, keep-last-N, the newest intact checkpoint), RNG state,
                 the out_dir and async_save pre-checks
    async_save.py `train.async_save`: the host copy in the step loop, the writing in a thread
    expert_files.py a sparse model's experts at ep > 1 by global expert id: written beside
                 DeepSpeed's files, each rank's own put back on resume, all of them for load_model
    reshape.py   resume at another tp, dp or ZeRO stage through DeepSpeed's universal checkpoint
    reshape_experts.py a sparse model's experts in a reshape: converted from their expert-dp ZeRO
                 partitions and loaded by global expert id, so a run continues at another ep
    loading.py   `load_checkpoint_config`, `load_model` at any tp and ep (no DeepSpeed engine)
    run_lock.py  `RunLock`: one trainer at a time on train.out_dir (a flock on run.lock, a heartbeat, stale takeover)

    model, cfg, info = load_model("runs/quickstart-<time>")   # after init_distributed, at any tp
"""

from cplm_dist.checkpoint.loading import load_checkpoint_config, load_model, read_checkpoint
from cplm_dist.checkpoint.manifest import (CARRIED_TOKENIZER, COMPLETE, FORMAT, LATEST, Layout, Manifest, ReshapeError,
                                           carry_tokenizer, check_config_change, check_intact, check_layout, check_reshape,
                                           complete_tags, damaged_files, final_checkpoint, find_resume, latest_tag, layout_change, newest_readable,
                                           read_manifest, resolve_checkpoint, tag_for, tokenizer_files, upgrade, versions,
                                           write_manifest)
from cplm_dist.checkpoint.run_lock import LOCK_NAME, LockHolder, RunLock, read_holder
from cplm_dist.checkpoint.safe_io import (deepspeed_safe_globals, layer_states_name, load_states, model_states_file,
                                          model_states_name, safe_load, same_weights, use_safe_loading,
                                          weights_only_torch_load)
from cplm_dist.checkpoint.saver import (Checkpointer, check_async_save, check_out_dir, checkpoint_bytes, checkpoint_files,
                                        rng_state, set_rng_state)
from cplm_dist.config import RESUMABLE_CHANGES
from cplm_dist.errors import CheckpointError

__all__ = [
    "CARRIED_TOKENIZER", "COMPLETE", "FORMAT", "LATEST", "LOCK_NAME", "RESUMABLE_CHANGES", "CheckpointError", "Checkpointer",
    "Layout", "LockHolder", "Manifest", "ReshapeError", "RunLock", "carry_tokenizer", "check_config_change",
    "check_async_save", "check_intact", "check_layout", "check_out_dir", "check_reshape", "checkpoint_bytes", "checkpoint_files", "complete_tags", "damaged_files",
    "deepspeed_safe_globals", "final_checkpoint", "find_resume", "latest_tag", "layer_states_name", "layout_change", "load_checkpoint_config",
    "load_model", "load_states", "model_states_file", "model_states_name", "newest_readable", "read_checkpoint",
    "read_holder", "read_manifest", "resolve_checkpoint", "rng_state", "safe_load", "same_weights", "set_rng_state", "tag_for", "tokenizer_files",
    "upgrade", "use_safe_loading", "versions", "weights_only_torch_load", "write_manifest",
]
