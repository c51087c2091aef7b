from cplm_dist.evaluation.harness_tasks import TASKS_DIR

print(TASKS_DIR)
