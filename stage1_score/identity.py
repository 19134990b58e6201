"""Which stage-1 options make a cache's identity: the teacher (and how it is loaded), its
tokenizer, the corpus and how it is read, the windows and what each token row holds. A rerun
with another value of one of them refuses to mix into an existing cache; every other option
changes only how fast, where or how visibly the cache is built (recorded in stage1-run.json).
--help marks each option so; tests/test_stage1_config.py holds this set to what
stage1_score.job.plan() puts in the identity."""

from __future__ import annotations

CACHE_IDENTITY = frozenset(
    {
        # the teacher record: the model, its revision, dtype and backend
        "teacher", "teacher_revision", "dtype", "backend",
        # the tokenizer record (--student-tokenizer: the template a `student` rendering uses)
        "tokenizer", "student_tokenizer",
        # the corpus record: Corpus.describe()
        "corpus", "text_column", "id_column", "split", "text_split", "on_bad_record", "targets",
        "spans_column", "messages_column", "chat_template", "max_docs",
        # the result settings: result_settings()
        "max_length", "stride", "docs_per_shard", "loss_dtype", "topk_probs", "topk_ids",
        "topk_encoding", "topk_mode", "sample_seed", "space_logprob",
    }
)  # fmt: skip


def identity_mark(key: str) -> str:
    """The tag --help puts after an option's text (stage1_score/run.py's DESCRIPTION says what
    each means)."""
    return "[identity]" if key in CACHE_IDENTITY else "[run only]"
