"""The cache contract, both sides of it: the shard schema, the manifest, the writer that builds a
unit's table, verification and statistics. Stage 1 writes through it, stage 2 and every tool read
through it; neither declares a column of its own."""
