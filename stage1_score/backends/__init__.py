"""Scoring backends: `hf` (transformers, any machine) and `vllm` (GPU); same windows, same output."""
