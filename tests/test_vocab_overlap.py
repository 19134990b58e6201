"""Vocabulary overlap (paper Figure 1) on the real tokenizers and on hand-made vocabularies."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers

from pipeline.tokenizer import FramingPolicy, TextTokenizer, load_tokenizer
from pipeline.vocab_overlap import vocabulary_overlap


def word_tokenizer(words: list[str]) -> TextTokenizer:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return TextTokenizer(backend, FramingPolicy(False, None, None), "words")


def test_paper_figure_1_qwen_teacher_shares_6_32_percent_with_tinyllama():
    overlap = vocabulary_overlap(load_tokenizer("tinyllama"), load_tokenizer("qwen2.5"))
    assert round(100 * overlap.shared_over_teacher, 2) == 6.32
    assert (overlap.student_vocab, overlap.teacher_vocab) == (32000, 151665)
    assert overlap.shared_over_student == overlap.shared / 32000


def test_hand_made_vocabularies_count_exact_string_matches():
    student = word_tokenizer(["<unk>", "a", "b", "c", "▁d"])
    teacher = word_tokenizer(["<unk>", "b", "c", "Ġd", "e", "f", "g", "h"])
    overlap = vocabulary_overlap(student, teacher)
    assert overlap.to_dict() == {
        "shared": 3,  # <unk>, b, c; "▁d" and "Ġd" are different strings
        "student_vocab": 5,
        "teacher_vocab": 8,
        "shared_over_teacher": 3 / 8,
        "shared_over_student": 3 / 5,
    }
    assert list(overlap.to_dict()) == [
        "shared",
        "student_vocab",
        "teacher_vocab",
        "shared_over_teacher",
        "shared_over_student",
    ]


def test_overlap_is_symmetric_in_shared_count_and_total_with_itself():
    mistral, deepseek = load_tokenizer("mistral"), load_tokenizer("deepseek")
    forward, backward = vocabulary_overlap(mistral, deepseek), vocabulary_overlap(deepseek, mistral)
    assert forward.shared == backward.shared
    assert forward.shared_over_teacher == backward.shared_over_student
    same = vocabulary_overlap(deepseek, deepseek)
    assert same.shared == same.teacher_vocab == deepseek.vocab_size
    assert same.shared_over_teacher == same.shared_over_student == 1.0
