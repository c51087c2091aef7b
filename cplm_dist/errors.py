"""Errors the user can fix: each message is one line naming the problem and the fix.

Entry points turn a `UsageError` into that line on stderr and exit code 2 (cplm_dist.config.cli);
everything else is a bug and keeps its traceback.
"""


class UsageError(ValueError):
    """Bad input from the user: a config, a command line, a data file, a checkpoint, a launch."""


class ConfigError(UsageError):
    """A bad config value or command-line override."""


class DataError(UsageError):
    """A missing, empty, malformed or mismatched data file or tokenizer."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be resumed from or loaded (missing, incomplete, damaged, another layout)."""


class LaunchError(UsageError):
    """A launch the job cannot run under: the hosts cannot reach each other, a rank never arrived,
    a directory that must be shared is node-local."""


class HFImportError(UsageError):
    """A Hugging Face directory that cannot initialise this model (a backbone's HF adapter checks
    its config.json: cplm_dist.config.backbones; the directory: cplm_dist.interop.hf.directory)."""
