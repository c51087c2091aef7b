"""Hugging Face transformers <-> CPLM: each backbone family's name and layout map (llama.py,
gpt2.py), the directory side they share, and the remote classes a copy-on export carries (remote/)."""
