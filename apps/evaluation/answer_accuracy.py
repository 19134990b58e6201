"""Math answer accuracy by greedy generation with a few-shot prompt (GSM8K style, `#### N`).

Documents are "Question: ...\nAnswer: <steps> #### N". The prompt is the shots' full texts, then
the held-out question and "Answer:"; the completion is cut at the next "Question:" and its
`#### N` compared numerically with the reference answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from pipeline.tokenizer import TextTokenizer

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_DONE = re.compile(r"####\s*-?[\d,]*\.?\d+\s*\n|\nQuestion:")
_ANSWER_MARK = "\nAnswer:"


@dataclass(frozen=True)
class Problem:
    question: str  # "Question: ..." without the answer
    answer: str  # the reference final answer


def problem_from_document(text: str, answer: str | None = None) -> Problem:
    if _ANSWER_MARK not in text:
        raise ValueError("document has no '\\nAnswer:' line")
    question = text.split(_ANSWER_MARK, 1)[0]
    reference = answer if answer is not None else extract_answer(text)
    if reference is None:
        raise ValueError("document has no '#### N' final answer")
    return Problem(question=question, answer=str(reference))


def extract_answer(completion: str) -> str | None:
    match = _FINAL.search(completion.split("\nQuestion:", 1)[0])
    return match.group(1).replace(",", "") if match else None


def same_number(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    try:
        return abs(float(predicted) - float(reference.replace(",", ""))) < 1e-6
    except ValueError:
        return predicted.strip() == reference.strip()


class FinalAnswerStop(StoppingCriteria):
    """Stop each row once it has written its `#### N` line or begun another question.

    Rows stop independently; without this every row runs to max_new_tokens.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_width: int):
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.backend.decode_batch(
            input_ids[:, self.prompt_width :].tolist(), skip_special_tokens=True
        )
        return torch.tensor([bool(_DONE.search(t)) for t in texts], device=input_ids.device)


def build_prompt(shots: list[str], problem: Problem) -> str:
    return "\n\n".join([*shots, problem.question + _ANSWER_MARK])


@torch.inference_mode()
def answer_accuracy(
    model,
    tokenizer: TextTokenizer,
    problems: list[Problem],
    shots: list[str],
    *,
    max_new_tokens: int = 160,
    batch_size: int = 8,
) -> dict:
    """Greedy, left-padded batched generation; returns accuracy and every problem's outcome."""
    device = next(model.parameters()).device
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    outcomes = []
    for begin in range(0, len(problems), batch_size):
        batch = problems[begin : begin + batch_size]
        encoded = tokenizer.encode_batch([build_prompt(shots, p) for p in batch])
        width = max(len(e) for e in encoded)
        ids = np.full((len(batch), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, enc in enumerate(encoded):
            ids[row, width - len(enc) :] = enc.ids
            mask[row, width - len(enc) :] = 1
        generated = model.generate(
            input_ids=torch.from_numpy(ids).to(device),
            attention_mask=torch.from_numpy(mask).to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([FinalAnswerStop(tokenizer, width)]),
        )
        for problem, row in zip(batch, generated[:, width:].tolist(), strict=True):
            completion = tokenizer.backend.decode(row, skip_special_tokens=True)
            predicted = extract_answer(completion)
            outcomes.append(
                {
                    "question": problem.question,
                    "reference": problem.answer,
                    "predicted": predicted,
                    "correct": same_number(predicted, problem.answer),
                    "completion": completion.split("\nQuestion:", 1)[0],
                }
            )
    correct = sum(o["correct"] for o in outcomes)
    return {
        "accuracy": correct / max(len(outcomes), 1),
        "correct": correct,
        "problems": len(outcomes),
        "outcomes": outcomes,
    }
