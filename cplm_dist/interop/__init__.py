"""Weights in from and out to other formats: `model.init_from` (one of our checkpoints or a
Hugging Face directory, init_from.py) and transformers (hf/: one map a backbone family, the
directory side they share, the remote classes of a copy-on export)."""
