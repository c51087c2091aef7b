"""Hugging Face transformers <-> CPLM: the directory side every backbone shares (directory.py:
reading a save_pretrained directory, writing an export) and the remote classes a copy-on export
carries (remote/). Each backbone's map (config keys, weight names) is its record's adapter, in
cplm_dist/config/backbones/ beside the record."""
