"""Data: tokenizer, raw sources, Megatron indexed shards, blended datasets, the resumable loader.

Flow: raw files (sources) -> tokenizer -> indexed_data (.bin/.idx) -> gpt_data (megatron's
GPTDataset + blending) -> loader (micro-batches per dp rank, resumable).
"""
