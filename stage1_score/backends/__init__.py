"""Stage 1's vLLM backend. The transformers backend, which evaluation shares, is the library's
`pipeline.scoring.hf`; both cut the same windows and give the same output."""
