"""The embedded default: the whole pipeline end to end on a CPU, as a new user first runs it."""
