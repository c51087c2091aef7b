"""The training step and what it is made of (the `cplm-train` driver that runs it is cplm_dist.train):

    step.py            the one optimizer step (training runs it, the profiler measures it)
    engine.py          the DeepSpeed engine from the typed config
    mpu.py             what DeepSpeed asks of our parallel groups (`DeepSpeedMPU`; its pipeline grid with a cp axis)
    pipeline.py        parallel.pp > 1: the model's parts as DeepSpeed pipeline stages, their micro-batch loss
    reduction.py       the one reduction of a batch's figures over dp x cp; fault injection (train.inject_fault)
    optim.py           AdamW groups, the schedules, the non-finite guard; muon.py, zero_partitions.py optim.name=muon
    stability.py       loss and gradient-norm spikes (train.spike_zscore)
    validation_loss.py the validation loss (pipeline or not)
    run_log.py         console, metrics.jsonl, TensorBoard; wandb_log.py Weights & Biases
    throughput.py      FLOPs per token, MFU, peak memory
"""
