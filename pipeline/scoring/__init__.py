"""Scoring a text with a causal LM: load a teacher, cut documents into overlapping windows, batch
them, and compute every token's loss. Stage 1 runs it over a corpus; `vocagno eval` measures any
model with the very same code."""
