"""The transformers side of a copy-on export: a `CPLMForCausalLM` that tools/export_hf.py copies
into the exported directory (loaded with trust_remote_code=True). These files import only torch
and transformers, so the exported model runs where cplm_dist is not installed."""
