"""`python -m cplm_dist.evaluation.harness_tasks`: prints the shipped lm-eval tasks' directory (for
lm_eval's --include_path)."""

from cplm_dist.evaluation.harness_tasks import TASKS_DIR

print(TASKS_DIR)
