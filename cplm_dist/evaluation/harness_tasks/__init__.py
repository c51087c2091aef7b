"""The lm-eval task set cplm_dist ships (`--tasks cplm_local`, or each task by name); see local_datasets.py.

`python -m cplm_dist.evaluation.harness_tasks` prints this directory, for lm_eval's --include_path.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
