"""`vocagno eval`: load a model once, measure bits per character, answer bits per character given
the question (the primary metric, README: on by default, 200 problems), and answer accuracy. Both
answer metrics use the same held-out problems (those after the bits-per-character documents), in
the same order, so models can be compared problem by problem."""

from __future__ import annotations

import sys

from apps.evaluation.answer_accuracy import answer_accuracy, problem_from_document
from apps.evaluation.answer_bits import answer_bits
from apps.evaluation.bits_per_character import bits_per_character, score_documents
from apps.evaluation.config import EvalConfig
from apps.evaluation.last_word import last_word_accuracy
from pipeline.config import to_dict
from pipeline.corpus import Corpus, CorpusOptions, Document
from pipeline.errors import CorpusError
from pipeline.io import atomic_write_json
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import (
    check_model_weights,
    load_teacher_config,
    load_teacher_tokenizer,
    resolve_teacher,
    teacher_context_length,
)
from pipeline.shipped import shipped_corpus

DEFAULT_CONTEXT = 2048


def evaluation_documents(
    spec: str, count: int, options: CorpusOptions | None = None
) -> tuple[list[Document], int]:
    """The first `count` usable documents, and how many bad records were passed over on the way
    (only with on_bad_record="skip"; otherwise the first bad one stops with its file and record)."""
    documents, skipped = [], 0
    for item in Corpus(spec, options):
        if len(documents) == count:
            break
        if isinstance(item, Document):
            documents.append(item)
        else:
            skipped += 1
    return documents, skipped


def evaluate(config: EvalConfig) -> dict:
    source = resolve_teacher(config.model, role="model")
    model_config = load_teacher_config(source)
    check_model_weights(source, model_config)
    tokenizer = load_teacher_tokenizer(source, config.tokenizer)
    max_length = config.max_length or min(
        teacher_context_length(model_config) or DEFAULT_CONTEXT, DEFAULT_CONTEXT
    )
    scorer = HFScorer(
        source,
        max_length=max_length,
        stride=max_length // 2,
        batch_tokens=config.batch_tokens,
        asked=Asked(config.dtype),
        extras=HeadExtras(topk=1) if config.last_words else None,  # the greedy token's id
    ).load()
    report: dict = {"model": config.model, "tokenizer": tokenizer.spec, "config": to_dict(config)}
    data = config.data or str(shipped_corpus("eval"))
    # One read of the held-out data: the documents for bits per character, then the problems,
    # which come after them so the two never overlap.
    count = max(config.answer_problems, config.accuracy_problems)
    options = CorpusOptions(
        on_bad_record=config.on_bad_record,
        targets=config.targets,
        chat_template=config.chat_template,
    )
    documents, skipped = evaluation_documents(data, config.num_docs + count, options)
    docs = documents[config.num_docs :]
    if count and len(docs) < count:
        _few_problems(len(docs), config)
    if config.num_docs:
        texts = [d.text for d in documents[: config.num_docs]]
        print(f"eval: bits per character over {len(texts)} documents", file=sys.stderr)
        scored = score_documents(scorer, tokenizer, texts)
        report["bits_per_character"] = bits_per_character(
            scorer, tokenizer, texts, scored
        ).to_json()
        if config.last_words:
            print(f"eval: last-word accuracy over {len(texts)} documents", file=sys.stderr)
            accuracy = last_word_accuracy(scorer, tokenizer, texts, scored)
            report["last_word_accuracy"] = accuracy.to_json()
    if config.answer_problems:
        problems = docs[: config.answer_problems]
        texts = [d.text for d in problems]
        print(f"eval: answer bits per character on {len(texts)} problems", file=sys.stderr)
        spans = None if config.targets == "all" else [d.target_spans for d in problems]
        report["answer_bits"] = answer_bits(scorer, tokenizer, texts, spans).to_json()
    if config.accuracy_problems:
        shots_data = config.shots_data or str(shipped_corpus("train"))
        shot_documents, _ = evaluation_documents(
            shots_data, config.shots, CorpusOptions(on_bad_record=config.on_bad_record)
        )
        shots = [d.text for d in shot_documents]
        problems = [problem_from_document(d.text) for d in docs[: config.accuracy_problems]]
        print(f"eval: answer accuracy on {len(problems)} problems", file=sys.stderr)
        report["answer_accuracy"] = answer_accuracy(
            scorer.model,
            tokenizer,
            problems,
            shots,
            max_new_tokens=config.max_new_tokens,
            batch_size=config.generation_batch,
        )
    report["skipped_records"] = skipped
    if config.out:
        atomic_write_json(config.out, report)
    return report


def _few_problems(found: int, config: EvalConfig) -> None:
    """Fewer held-out problems than asked: said on stderr, or refused when none is left."""
    asked = f"--answer-problems {config.answer_problems}, --accuracy-problems "
    asked += f"{config.accuracy_problems}"
    if not found:
        raise CorpusError(
            f"no held-out problems left after the {config.num_docs} bits-per-character "
            f"documents ({asked}): pass 0 for both, or a smaller --num-docs"
        )
    print(f"eval: only {found} held-out problems after the documents ({asked})", file=sys.stderr)
