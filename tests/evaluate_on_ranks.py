"""Run under torchrun by tests/test_stage2_evaluation.py: one held-out evaluation of a seeded
llama-tiny student (the same weights on every rank), wrapped as stage 2 wraps it (DDP, or FSDP
with --fsdp), on the first documents of a corpus; rank 0 writes the result as JSON.

    torchrun --nproc-per-node N tests/evaluate_on_ranks.py CORPUS DOCS SEQ_LEN ROWS OUT [--fsdp]
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.models.student import build_student  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.data.heldout import read_heldout  # noqa: E402
from stage2_train.distributed import Runtime  # noqa: E402
from stage2_train.evaluation import evaluate  # noqa: E402
from stage2_train.parallel import wrap  # noqa: E402


def main(argv: list[str]) -> None:
    corpus, docs, seq_len, rows, out = argv[:5]
    runtime = Runtime.start()
    try:
        tokenizer = load_tokenizer("tinyllama")
        heldout = read_heldout(corpus, int(docs), tokenizer, int(seq_len), int(rows))
        student = build_student("llama-tiny", tokenizer, seed=0, seq_len=int(seq_len))
        model = wrap(student, runtime, "--fsdp" in argv, "none", "float32", False)
        result = evaluate(model, heldout, runtime, contextlib.nullcontext, "plain")
        if runtime.is_main:
            fields = {"loss": result.loss, "bits_per_char": result.bits_per_char,
                      "batches": len(heldout.batches)}  # fmt: skip
            Path(out).write_text(json.dumps(fields))
    finally:
        runtime.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
