"""Stream the cache into packed training sequences whose target tokens carry teacher losses.

plan       what fixes the stream, and which consumer reads which part of which shard
shards     the shards a reader opens, each verified against its manifest
documents  reading a shard, checking its rows, and giving every student token its teacher loss
more_teachers  other teachers' caches of the corpus, read in step (--more-caches)
packing    stream packing: one consumer's token stream cut into windows (--packing stream)
document_packing  context-true packing: whole documents, best-fit, per-document masks
streams    the consumer stream of the plan's packing
position   where a consumer's stream continues, and a rank's data state in a checkpoint
loader     a rank's DataLoader over its consumers
"""
