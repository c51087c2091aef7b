"""Evaluation: load a checkpoint for inference, the copy / retrieval suite, the gradient bottleneck."""
