"""The paper's analyses as reproducible tools: one module per figure (`vocagno analyze ...`).

  - `vocabulary_overlap`: Figure 1, how much of each teacher's vocabulary the student shares.
  - `chunk_overlap`: Figures 3 and 6, character IoU/IoS of equal-chunk alignment against the
    number of chunks, with token-level lexical alignment as the reference.
  - `training_curves`: loss and kept/mapped fractions of training runs from their metrics.jsonl.

Each writes its table with the configuration and fingerprints that produced it, and a PNG.
"""
