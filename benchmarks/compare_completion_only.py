"""Does training on the answers alone change a student's answers? Completion-only targets
against all targets on the shipped chat example (docs/instruction-data.md), from one cache.

The design, fixed before the first run (committed with this script):
- Cache: stage 1 with SmolLM2-135M-Instruct on the first 400 records of the shipped chat example
  (pipeline/assets/corpus/gsm_symbolic-chat-train.jsonl.zst), `--targets chat` (chatml),
  `--max-length 512 --stride 256`.
- Arms, each `llama-demo` from scratch with the TinyLlama tokenizer (another vocabulary), 60
  steps of 4,096 tokens (--seq-len 512, --micro-batch-size 8, --lr 3e-3, --warmup-steps 3),
  seed 0, every other option stage 2's default: `none` and `token` (top 40% by excess loss),
  each with `--completion-only` (the default: the answers' tokens only) and
  `--no-completion-only` (every token).
- Measured: answer bits per character on the assistant spans of the 200 shipped chat-eval
  records (`vocagno eval --targets chat`), and, as the price, bits per character of the whole
  text of the same records (the questions included).
- Reported: each arm's values; targets-only - all-targets per guidance, and token - none per
  targets setting, with the paired bootstrap (over records, 95%). No threshold is tuned;
  whichever way it goes, as measured.

Usage: python benchmarks/compare_completion_only.py --cache DIR --work DIR
A rerun trains nothing already finished.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arm_runs import rate_difference, train_arm  # noqa: E402

from apps.evaluation.config import EvalConfig  # noqa: E402
from apps.evaluation.run import evaluate  # noqa: E402
from pipeline.shipped import shipped_corpus  # noqa: E402

STEPS = ("--max-steps", "60", "--global-batch-tokens", "4096", "--seq-len", "512",
         "--micro-batch-size", "8", "--lr", "3e-3", "--warmup-steps", "3", "--seed", "0")  # fmt: skip
ARMS = {  # arm: its stage-2 options
    "none/targets": ("--guidance", "none"),
    "none/all": ("--guidance", "none", "--no-completion-only"),
    "token/targets": ("--guidance", "token"),
    "token/all": ("--guidance", "token", "--no-completion-only"),
}
RECORDS = 200


def measure(final: Path) -> dict:
    data = str(shipped_corpus("chat-eval"))
    answers = evaluate(EvalConfig(model=str(final), data=data, targets="chat", num_docs=0,
                                  answer_problems=RECORDS, accuracy_problems=0, max_length=512))
    whole = evaluate(EvalConfig(model=str(final), data=data, targets="chat", num_docs=RECORDS,
                                answer_problems=0, accuracy_problems=0, max_length=512))  # fmt: skip
    return {"answer_bits": answers["answer_bits"], "bits_per_character": whole["bits_per_character"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="the --targets chat cache")
    parser.add_argument("--work", type=Path, required=True, help="runs and results are kept here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm, options in ARMS.items():
        path = args.work / f"{arm.replace('/', '-')}.json"
        if not path.exists():
            out = args.work / arm.replace("/", "-")
            final = train_arm(out, ["--cache", str(args.cache), "--student", "llama-demo",
                                    "--student-tokenizer", "tinyllama", *options, *STEPS])  # fmt: skip
            path.write_text(json.dumps(measure(final)))
        results[arm] = json.loads(path.read_text())
        print(f"{arm}: done", file=sys.stderr)

    def answers(arm):
        a = results[arm]["answer_bits"]
        return a["per_problem_bits"], a["per_problem_characters"]

    def whole(arm):
        b = results[arm]["bits_per_character"]
        return b["per_document_bits"], b["per_document_characters"]

    print(f"# {RECORDS} shipped chat-eval records; {' '.join(STEPS)}")
    for arm, r in results.items():
        print(f"{arm:<14} answer bits/char {r['answer_bits']['bits_per_character']:.4f}, "
              f"whole-text bits/char {r['bits_per_character']['bits_per_character']:.4f}")  # fmt: skip
    for metric, values in (("answer bits/char", answers), ("whole-text bits/char", whole)):
        for guidance in ("none", "token"):
            d = rate_difference(*values(f"{guidance}/targets"), *values(f"{guidance}/all"))
            print(f"{metric}: {guidance} targets-only - all-targets {d}")
        for targets in ("targets", "all"):
            d = rate_difference(*values(f"token/{targets}"), *values(f"none/{targets}"))
            print(f"{metric}: {targets}: token - none {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
