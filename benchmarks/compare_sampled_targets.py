"""Does training on the sampled cache's unbiased terms give another student than the top-k
terms? `kld` against `kld-sampled` and `uld` against `uld-sampled` (docs/distillation.md), with
`none` beside them, on caches of one real teacher over one corpus.

The design, fixed before the first run (committed with this script):
- Caches: stage 1 with SmolLM2-135M-Instruct (scripts/prepare_teacher.py) on the first 400
  shipped training documents, `--topk-probs 32` (the compact top-k) and `--topk-probs 32
  --topk-mode sampled` (32 draws): the same teacher, corpus and windows.
- Students: `llama-demo` from scratch; the KLD arms with SmolLM2's tokenizer (KLD compares one
  vocabulary), the ULD arms with TinyLlama's. Arms: none, kld, kld-sampled; none, uld,
  uld-sampled. Each arm: 60 steps of 4,096 tokens (--seq-len 512, --micro-batch-size 8, --lr
  3e-3, --warmup-steps 3), seeds 0 and 1, every other option stage 2's default.
- Measured on the first 100 documents of the shipped eval split, per seed:
  - bits per character (apps/evaluation: the project's held-out metric), and
  - for the SmolLM2-tokenizer students, the full KL(student || teacher) per predicted token from
    both whole softmaxes (the quantity `kld-sampled` estimates and `kld` bounds).
- Reported: each arm's value per seed; per seed, the paired bootstrap (over documents, 95%) of
  sampled - top-k and of each arm - none. No threshold is tuned; whichever way it goes, as
  measured.
Amended 2026-12-06, before the forward estimator's first run: `kld-sampled` now trains the
forward KL(teacher || student) from the draws (Sparse Logit Sampling's), so the full forward KL
per predicted token is reported beside the reverse one, for the SmolLM2-tokenizer students; the
arms, caches, steps, seeds and documents are the design's. A pair is reported wherever both of
its arms ran (`--arms`), each against `none` where that ran too.

Usage: python benchmarks/compare_sampled_targets.py --top-cache DIR --sampled-cache DIR
           --teacher DIR --work DIR
A rerun trains nothing already finished (each run's OUT/final is kept in --work).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arm_runs import rate_difference, train_arm  # noqa: E402

from apps.evaluation.bootstrap import paired_bootstrap  # noqa: E402
from apps.evaluation.config import EvalConfig  # noqa: E402
from apps.evaluation.run import evaluate, evaluation_documents  # noqa: E402
from pipeline.shipped import shipped_corpus  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402

SEEDS = (0, 1)
EVAL_DOCS = 100
MAX_TOKENS = 512
ARMS = {  # arm: (the student's tokenizer, the cache it reads)
    "none/smollm2": ("smollm2", "top"),
    "kld": ("smollm2", "top"),
    "kld-sampled": ("smollm2", "sampled"),
    "none/tinyllama": ("tinyllama", "top"),
    "uld": ("tinyllama", "top"),
    "uld-sampled": ("tinyllama", "sampled"),
}
STEPS = ("--max-steps", "60", "--global-batch-tokens", "4096", "--seq-len", "512",
         "--micro-batch-size", "8", "--lr", "3e-3", "--warmup-steps", "3")  # fmt: skip


def train(arm: str, seed: int, caches: dict[str, Path], work: Path) -> Path:
    """The arm's student (stage 2's entry script, as a user runs it); kept once finished."""
    tokenizer, cache = ARMS[arm]
    return train_arm(work / f"{arm.replace('/', '-')}-seed{seed}", [
        "--cache", str(caches[cache]), "--student", "llama-demo", "--student-tokenizer", tokenizer,
        "--guidance", arm.split("/")[0], "--seed", str(seed), *STEPS,
    ])  # fmt: skip


def full_kl(student_dir: Path, teacher, tokenizer, texts: list[str]) -> np.ndarray:
    """Per document, the means over its predicted tokens (the first MAX_TOKENS) of the exact
    KL(student || teacher) and KL(teacher || student) from both models' whole next-token
    distributions: [documents, 2]."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    per_document = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text).ids[:MAX_TOKENS]])
            s = torch.log_softmax(student(ids).logits[0, :-1].float(), -1)
            t = torch.log_softmax(teacher(ids).logits[0, :-1].float(), -1)
            if s.shape[-1] != t.shape[-1]:
                raise SystemExit(f"student vocabulary {s.shape[-1]} != teacher's {t.shape[-1]}")
            reverse, forward = (s.exp() * (s - t)).sum(-1), (t.exp() * (t - s)).sum(-1)
            per_document.append([float(reverse.mean()), float(forward.mean())])
    return np.asarray(per_document)


def measure(final: Path, tokenizer: str, teacher, texts: list[str]) -> dict:
    config = EvalConfig(model=str(final), num_docs=EVAL_DOCS, answer_problems=0,
                        accuracy_problems=0, max_length=MAX_TOKENS)  # fmt: skip
    bits = evaluate(config)["bits_per_character"]
    result = {
        "bits_per_character": bits["bits_per_character"],
        "per_document_bits": bits["per_document_bits"],
        "per_document_characters": bits["per_document_characters"],
    }
    if tokenizer == "smollm2":
        kl = full_kl(final, teacher, load_tokenizer(tokenizer), texts)
        result |= {"full_kl": float(kl[:, 0].mean()), "per_document_kl": kl[:, 0].tolist(),
                   "forward_kl": float(kl[:, 1].mean()),
                   "per_document_forward_kl": kl[:, 1].tolist()}  # fmt: skip
    return result


PER_DOCUMENT = {"full_kl": "per_document_kl", "forward_kl": "per_document_forward_kl"}


def difference(a: dict, b: dict, metric: str) -> str:
    if metric == "bits_per_character":  # a per-character rate: documents weighted by length
        return rate_difference(a["per_document_bits"], a["per_document_characters"],
                               b["per_document_bits"], b["per_document_characters"])  # fmt: skip
    key = PER_DOCUMENT[metric]
    d = paired_bootstrap(np.asarray(a[key]), np.asarray(b[key]))
    return f"{d.difference:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-cache", type=Path, required=True)
    parser.add_argument("--sampled-cache", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, required=True, help="the caches' teacher folder")
    parser.add_argument("--work", type=Path, required=True, help="runs and results are kept here")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="the seeds to train and report (the design's are 0 and 1)")  # fmt: skip
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="the arms to train and report (the design's are all)")  # fmt: skip
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    caches = {"top": args.top_cache, "sampled": args.sampled_cache}
    args.work.mkdir(parents=True, exist_ok=True)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    documents, _ = evaluation_documents(str(shipped_corpus("eval")), EVAL_DOCS)
    texts = [d.text for d in documents]
    results = {}
    for seed in args.seeds:
        for arm in args.arms:
            tokenizer = ARMS[arm][0]
            path = args.work / f"{arm.replace('/', '-')}-seed{seed}.json"
            if not path.exists():
                final = train(arm, seed, caches, args.work)
                path.write_text(json.dumps(measure(final, tokenizer, teacher, texts)))
            results[arm, seed] = json.loads(path.read_text())
            print(f"{arm} seed {seed}: done", file=sys.stderr)
    print(f"# {EVAL_DOCS} shipped eval documents; {' '.join(STEPS)}; seeds {args.seeds}")
    for seed in args.seeds:
        for arm in args.arms:
            r = results[arm, seed]
            kl = "".join(
                f", {name} {r[metric]:.4f} nats/token"
                for metric, name in (("full_kl", "full KL(s || t)"), ("forward_kl", "KL(t || s)"))
                if metric in r
            )
            print(f"seed {seed} {arm:<15} bits/char {r['bits_per_character']:.4f}{kl}")
        for sampled, top, none in (("kld-sampled", "kld", "none/smollm2"),
                                   ("uld-sampled", "uld", "none/tinyllama")):  # fmt: skip
            if not {sampled, top} <= set(args.arms):
                continue
            r = {arm: results[arm, seed] for arm in (sampled, top, none) if arm in args.arms}
            for metric in ("bits_per_character", "full_kl", "forward_kl"):
                if metric != "bits_per_character" and metric not in r[sampled]:
                    continue
                pairs = [(sampled, top)] + [(arm, none) for arm in (top, sampled) if none in r]
                print(f"seed {seed} {metric}: " + "; ".join(
                    f"{a} - {b.split('/')[0]} {difference(r[a], r[b], metric)}" for a, b in pairs
                ))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
