"""The demo's steps: a plain warm start of the student, stage 1 as a Ray job on a local cluster,
each arm's continual pretraining from the warm start under `torchrun`, then `vocagno eval` of
every student and a report with the pre-registered comparison. Finished steps are reused on a
rerun (the warm start and each arm's final model, stage 1's finished shards)."""

from __future__ import annotations

import itertools
import json
import resource
import sys
import time
from pathlib import Path

from apps.demo.arms import REPO, ArmRun, Tables, arm_done, check_tables, train_arm
from apps.demo.config import WARM_START_OFFSET, DemoConfig
from apps.demo.ray_cluster import local_ray_cluster, submit_and_follow
from apps.demo.report import write_report
from apps.evaluation.config import EvalConfig
from pipeline.config import from_dict
from pipeline.io import atomic_path, atomic_write_json, open_binary_stream
from pipeline.log import get_logger
from pipeline.shipped import shipped_corpus
from stage2_train.config import TrainConfig


def check_stage_tables(config: DemoConfig, manifest: Path) -> Tables:
    """The demo's tables, each arm a guidance mode over [stage2] (apps.demo.arms.check_tables);
    the columns the arms read, those of a cache made elsewhere where one is given (`[dose]
    cache`)."""
    corpus = str(config.out / "corpus" / "train.jsonl")
    arms = {arm: {"guidance": arm} for arm in config.arms}
    return check_tables(config, manifest, corpus, arms, carried=getattr(config, "cache", None))


log = get_logger("demo").info


def write_corpus_slice(dest: Path, count: int, start: int = 0) -> Path:
    """Documents [start, start + count) of the shipped training split, as plain JSON lines."""
    if dest.exists():
        return dest
    with open_binary_stream(shipped_corpus("train")) as lines, atomic_path(dest) as tmp:
        tmp.write_bytes(b"".join(itertools.islice(lines, start, start + count)))
    return dest


def warm_start_done(config: DemoConfig) -> bool:
    return (config.out / "warm-start" / "config.json").exists()


def make_warm_start(
    config: DemoConfig, stage2: TrainConfig, heldout: list[str] | None = None, every: int = 0
) -> Path:
    """The student every arm continues from, pretrained once on its own slice and reused;
    `heldout` documents' loss is recorded every `every` steps (apps.demo.warm_start)."""
    if warm_start_done(config):
        return config.out / "warm-start"
    corpus = write_corpus_slice(
        config.out / "corpus" / "warm-start.jsonl", config.warm_start_docs, WARM_START_OFFSET
    )
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    return train_warm_start_of(
        config, stage2, texts, steps=config.warm_start_steps, lr=config.warm_start_lr,
        min_lr=config.warm_start_min_lr, warmup_steps=config.warm_start_warmup, heldout=heldout,
        heldout_every=every,
    )  # fmt: skip


def train_warm_start_of(config, stage2: TrainConfig, texts: list[str], **schedule) -> Path:
    """OUT/warm-start: `config.student` trained plainly on `texts` in [stage2]'s shape (seed,
    sequence length, batch, weight decay), one thread per rank, by `schedule`
    (apps.demo.warm_start.train_warm_start's steps, rates, held-out loss and plateau stop)."""
    from apps.demo.warm_start import train_warm_start

    return train_warm_start(
        config.out / "warm-start", config.student, config.student_tokenizer, texts,
        seed=stage2.optimizer.seed, seq_len=stage2.data.seq_len,
        batch_sequences=stage2.optimizer.global_batch_tokens // stage2.data.seq_len,
        weight_decay=stage2.optimizer.weight_decay, threads=config.nproc_per_node, **schedule,
    )  # fmt: skip


def cache_done(config: DemoConfig) -> bool:
    return (config.out / "cache" / "manifest.json").exists()


def eval_path(config: DemoConfig, name: str) -> Path:
    return config.out / "eval" / f"{name}.json"


def score_with_ray(config: DemoConfig, manifest: Path, teacher: Path, corpus: Path) -> Path:
    cache = config.out / "cache"
    if cache_done(config):
        return cache
    # The job runs in Ray's copy of the repository: every path it is given is absolute.
    entrypoint = [
        sys.executable, "stage1_score/run.py", "--manifest", str(manifest.resolve()),
        "--teacher", str(teacher.resolve()), "--corpus", str(corpus.resolve()),
        "--out", str(cache.resolve()),
    ]  # fmt: skip
    with local_ray_cluster(config.ray_cpus, config.out / "logs" / "ray-head.log") as cluster:
        log(f"Ray cluster up at {cluster.address}; submitting stage 1")
        submit_and_follow(cluster, f"vocagno-demo-stage1-{int(time.time())}", entrypoint, REPO)
    return cache


def teacher_folder(config, steps: StepTimings) -> Path:
    """`config.teacher`, else SmolLM2-135M-Instruct prepared offline (timed as `teacher`)."""
    from pipeline.models.teacher_assets import prepare_smollm2_teacher

    log("preparing the teacher (SmolLM2-135M-Instruct, offline)")
    if config.teacher:
        return Path(config.teacher)
    return steps.timed("teacher", False, prepare_smollm2_teacher)


def score_train_docs(config, manifest: Path, teacher: Path, steps: StepTimings) -> Path:
    """Stage 1 of the train split's first `train_docs` documents into OUT/cache (`stage1`)."""
    corpus = write_corpus_slice(config.out / "corpus" / "train.jsonl", config.train_docs)
    log(f"stage 1: scoring {config.train_docs:,} documents with the teacher")
    return steps.timed(
        "stage1", cache_done(config), score_with_ray, config, manifest, teacher, corpus
    )


def evaluate_models(config: DemoConfig, settings: dict, models: dict[str, Path]) -> dict:
    from apps.evaluation.run import evaluate

    results = {}
    for name, model in models.items():
        dest = eval_path(config, name)
        if not dest.exists():
            log(f"evaluating {name}")
            evaluate(from_dict(EvalConfig, {**settings, "model": str(model), "out": dest}))
        results[name] = json.loads(dest.read_text())
    return results


def inspect_guided_arm(
    config: DemoConfig, stage2: TrainConfig, cache: Path, arms: dict
) -> Path | None:
    """The paper's Figure 8 for the guided student: which tokens the teacher made it train on."""
    from transformers import AutoModelForCausalLM

    from apps.analysis.guidance_page import find_document, guided_tokens, write_guidance_page
    from pipeline.guidance import GuidanceSettings
    from pipeline.tokenizer import load_tokenizer

    if "token" not in arms:
        return None
    student = arms["token"] / "final"
    document = find_document(cache, None, 0)
    guidance = stage2.guidance
    settings = GuidanceSettings(mode="token", topk=guidance.topk, unmapped=guidance.unmapped)
    model = AutoModelForCausalLM.from_pretrained(student).eval()
    tokens = guided_tokens(
        document, model, load_tokenizer(str(student)), settings, guidance.aggregate
    )
    dest = config.out / "inspect.html"
    write_guidance_page(dest, document, tokens, "guided student: teacher guidance on one document")
    return dest


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class StepTimings:
    """OUT/timings.json: each step's wall and CPU seconds, kept across reruns."""

    def __init__(self, out: Path):
        self.path = out / "timings.json"
        self.seconds = json.loads(self.path.read_text()) if self.path.exists() else {}

    def timed(self, name: str, done: bool, fn, *args):
        """Run a step; its wall time is kept only from the run that did the work, with its CPU
        time (this process and the subprocesses it waited for: torchrun and its ranks; not the
        Ray cluster's workers), which a machine shared with other work inflates far less."""
        start, cpu = time.monotonic(), _cpu_seconds()
        result = fn(*args)
        if not done:
            self.seconds[name] = round(time.monotonic() - start, 1)
            self.seconds.setdefault("cpu", {})[name] = round(_cpu_seconds() - cpu, 1)
            atomic_write_json(self.path, self.seconds)
        return result


def run_demo(config: DemoConfig, manifest: Path) -> Path:
    stage2, eval_settings, prereg = check_stage_tables(config, manifest)
    config.out.mkdir(parents=True, exist_ok=True)
    steps = StepTimings(config.out)
    timed, timings = steps.timed, steps.seconds
    teacher = teacher_folder(config, steps)
    log(
        f"warm start: {config.student} trained plainly for {config.warm_start_steps} steps on "
        f"{config.warm_start_docs} documents disjoint from the continual-pretraining slice"
    )
    student = timed("warm-start", warm_start_done(config), make_warm_start, config, stage2)
    cache = score_train_docs(config, manifest, teacher, steps)
    arms = {}
    for arm in config.arms:
        log(f"stage 2: training arm --guidance {arm} with torchrun x{config.nproc_per_node}")
        arms[arm] = timed(
            f"stage2-{arm}", arm_done(config, arm), train_arm, config, manifest, cache, student,
            ArmRun(arm, guidance=arm), True,
        )  # fmt: skip
    models = {"warm-start": student}
    models.update({arm: out / "final" for arm, out in arms.items()})
    evaluated = all(eval_path(config, name).exists() for name in models)
    results = timed("eval", evaluated, evaluate_models, config, eval_settings, models)
    inspect_guided_arm(config, stage2, cache, arms)
    report = write_report(config, manifest, teacher, cache, arms, results, timings, prereg)
    log(f"done: {report}")
    return report
