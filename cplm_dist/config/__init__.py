"""One typed config tree, loaded from YAML, overridden from the command line, validated at load.

    cfg = load_config("configs/models/tiny.yaml", ["model.num_layers=4", "copy.mix=joint"])

    tree.py        the dataclasses (one a section, `Config` their root), the `resumable` marks
    loading.py     YAML + `base:` + dotted overrides -> the typed tree (`load_config`, `from_dict`)
    validation.py  cross-field checks at load; the parallel layout (Layout), and the batch's once the world is known (BatchLayout)
    editing.py     a run config's YAML edited as text, comments and order kept (plan --write)
    curriculum.py  data.stages: the staged data mixture, which stage a step reads, the sources
    budget.py      train.train_tokens / data.stages[].from_tokens -> steps, at load
    notes.py       what loading decided for the user, said once (`note: ...` on stderr, first rank)
    backbones/     each backbone's record of features beside its HF adapter (validation reads the records)

Every error is a `ConfigError`: one line naming the field, the value and what would be valid.
"""

from cplm_dist.config.loading import CONFIG_DIR, apply_overrides, from_dict, load_config, parse_override, resolve_config_path
from cplm_dist.config.tree import (RESUMABLE_CHANGES, BlendEntry, Config, CopyConfig, DataConfig, LossConfig, ModelConfig,
                                   OptimConfig, ParallelConfig, RopeScaling, TrainConfig, resumable, to_dict)
from cplm_dist.config.validation import (BatchLayout, Layout, accumulation_steps, batch_layout, check_tp_divides, check_world,
                                         divisors, parse_split, validate, validate_data, validate_pipeline, validate_train)
from cplm_dist.errors import ConfigError

__all__ = [
    "CONFIG_DIR", "RESUMABLE_CHANGES", "BatchLayout", "BlendEntry", "Config", "ConfigError", "CopyConfig", "DataConfig",
    "Layout", "LossConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RopeScaling", "TrainConfig", "accumulation_steps",
    "apply_overrides", "batch_layout", "check_tp_divides", "check_world", "divisors", "from_dict", "load_config",
    "parse_override", "parse_split", "resolve_config_path", "resumable", "to_dict", "validate", "validate_data",
    "validate_pipeline", "validate_train",
]
