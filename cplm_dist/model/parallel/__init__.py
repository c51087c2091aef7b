"""The model's parallel pieces, in one place (tensor parallelism itself is megatron-core's linears,
built sharded in cplm_dist.model.parts):

    sequence.py   sequence parallelism: the gradient sums and gathers megatron's sp linears do not do
    context.py    context parallelism (parallel.cp): the 2 x cp chunks, K/V and copy-key gathers over cp
    stages.py     pipeline stages (parallel.pp): which layers a stage holds, the balanced split, their names
                  (DeepSpeed's PipelineModule of them: cplm_dist.training.pipeline)
    sharding.py   full <-> shard: whole state dicts at any tp
"""
