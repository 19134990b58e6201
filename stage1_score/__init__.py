"""Stage 1: score a corpus with a teacher into a reusable Parquet cache (see run.py)."""
