"""Stream the cache into packed training sequences whose target tokens carry teacher losses.

plan       what fixes the stream, and which consumer reads which part of which shard
documents  reading a shard, checking its rows, and giving every student token its teacher loss
packing    one consumer's documents packed into micro-batches of windows
position   where a consumer's stream continues, and a rank's data state in a checkpoint
loader     a rank's DataLoader over its consumers
"""
