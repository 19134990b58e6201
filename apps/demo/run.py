"""The demo's steps: a plain warm start of the student, stage 1 as a Ray job on a local cluster,
each arm's continual pretraining from the warm start under `torchrun`, then `vocagno eval` of
every student and a report with the pre-registered comparison. Finished steps are reused on a
rerun (the warm start and each arm's final model, stage 1's finished shards)."""

from __future__ import annotations

import itertools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from apps.demo.config import PREREGISTERED, WARM_START_OFFSET, DemoConfig, PreRegistration
from apps.demo.ray_cluster import local_ray_cluster, submit_and_follow
from apps.demo.report import write_report
from apps.evaluation.config import SECTION as EVAL_SECTION
from apps.evaluation.config import EvalConfig
from pipeline.config import from_dict, load_manifest_section
from pipeline.errors import ConfigError, VocagnoError
from pipeline.io import atomic_path, atomic_write_json, open_binary_stream
from pipeline.log import get_logger
from pipeline.shipped import shipped_corpus
from stage2_train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def check_stage_tables(
    config: DemoConfig, manifest: Path
) -> tuple[TrainConfig, dict, PreRegistration]:
    """Each stage's table checked as that stage will check it, with the options the demo gives
    it on the command line, and across the tables (each arm's distillation reads columns the
    cache holds): a bad value stops the demo here, before Ray starts or anything is written, not
    minutes later in a subprocess. Returns the stage-2 options, the [eval] table and the
    pre-registered comparison.
    """
    from stage1_score.config import ScoreConfig

    def table(section: str, given: dict) -> tuple[dict, str]:
        return {**load_manifest_section(manifest, section), **given}, f"{manifest} [{section}]"

    cache = str(config.out / "cache")  # a path or URI option in both stages
    teacher = config.teacher or "SmolLM2-135M-Instruct"  # prepared later; any name checks alike
    corpus = str(config.out / "corpus" / "train.jsonl")
    score = from_dict(
        ScoreConfig, *table("stage1", {"teacher": teacher, "corpus": corpus, "out": cache})
    )
    given = {
        "cache": cache,
        "student": config.student,  # the warm start is this preset, trained
        "student_tokenizer": config.student_tokenizer,
    }
    stage2 = [
        from_dict(
            TrainConfig,
            *table("stage2", {**given, "out": config.out / "arms" / arm, "guidance": arm}),
        )
        for arm in config.arms
    ]
    _check_arms_columns(config, manifest, score, stage2)
    settings, where = table(EVAL_SECTION, {})
    from_dict(EvalConfig, {**settings, "model": teacher}, where)
    prereg = from_dict(PreRegistration, *table(PREREGISTERED, {}))
    for pair in prereg.pairs():
        if not set(pair) <= set(config.arms):
            raise ConfigError(f"{manifest} [{PREREGISTERED}]: comparison {pair} names an arm "
                              f"not in arms {config.arms}")  # fmt: skip
    return stage2[0], settings, prereg


def _check_arms_columns(
    config: DemoConfig, manifest: Path, score, arms: list[TrainConfig]
) -> None:
    """Each arm's distillation reads only columns its cache will hold: a given cache's (`[dose]
    cache`), else those [stage1]'s options add."""
    from pipeline.cache.manifest import load_manifest
    from pipeline.distillation.columns import check_columns
    from stage1_score.config import result_settings

    given = getattr(config, "cache", None)
    if given and not (Path(given) / "manifest.json").is_file():
        return  # refused by name where the dose-response reads it
    if given:
        settings, cache = load_manifest(given).settings, f"cache {given}"
    else:  # the columns, not their types: any head size and space mask give the same ones
        settings = result_settings(score, 2, 1, head_size=1 << 16, space_mask={"planned": True})
        cache = f"the cache {manifest} [stage1] scores"
    for arm in arms:
        distillation = arm.guidance.distillation(arm.model, settings)
        if distillation is not None:
            check_columns(arm.guidance, distillation, cache, settings, arm.model)


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
    from apps.demo.warm_start import train_warm_start

    folder = config.out / "warm-start"
    if warm_start_done(config):
        return folder
    corpus = write_corpus_slice(
        config.out / "corpus" / "warm-start.jsonl", config.warm_start_docs, WARM_START_OFFSET
    )
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    return train_warm_start(
        folder,
        config.student,
        config.student_tokenizer,
        texts,
        seed=stage2.optimizer.seed,
        seq_len=stage2.data.seq_len,
        batch_sequences=stage2.optimizer.global_batch_tokens // stage2.data.seq_len,
        steps=config.warm_start_steps,
        lr=config.warm_start_lr,
        min_lr=config.warm_start_min_lr,
        warmup_steps=config.warm_start_warmup,
        weight_decay=stage2.optimizer.weight_decay,
        threads=config.nproc_per_node,
        heldout=heldout,
        heldout_every=every,
    )


def cache_done(config: DemoConfig) -> bool:
    return (config.out / "cache" / "manifest.json").exists()


def arm_done(config: DemoConfig, arm: str) -> bool:
    return (config.out / "arms" / arm / "final" / "config.json").exists()


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


def train_arm(config: DemoConfig, manifest: Path, cache: Path, student: Path, arm: str) -> Path:
    out = config.out / "arms" / arm
    if not arm_done(config, arm):
        run_stage2(config, manifest, cache, student, arm, out)
    return out


def run_stage2(
    config: DemoConfig, manifest: Path, cache: Path, student: Path, arm: str, out: Path,
    *options: str,
) -> None:  # fmt: skip
    """Stage 2 of one arm under torchrun, the manifest's [stage2] table and `options` over it;
    torchrun as this interpreter's module, which a Python with torch has even where no
    `torchrun` script sits beside the interpreter (a GPU machine's system Python)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={config.nproc_per_node}",
        "--standalone",
        "stage2_train/train.py", "--manifest", str(manifest), "--cache", str(cache),
        "--student", str(student), "--student-tokenizer", config.student_tokenizer,
        "--out", str(out), "--guidance", arm, *options,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise VocagnoError(f"stage 2 ({arm}) failed with exit code {result.returncode}")


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
    from pipeline.models.teacher_assets import prepare_smollm2_teacher

    stage2, eval_settings, prereg = check_stage_tables(config, manifest)
    config.out.mkdir(parents=True, exist_ok=True)
    steps = StepTimings(config.out)
    timed, timings = steps.timed, steps.seconds
    log("preparing the teacher (SmolLM2-135M-Instruct, offline)")
    teacher = (
        Path(config.teacher) if config.teacher else timed("teacher", False, prepare_smollm2_teacher)
    )
    log(
        f"warm start: {config.student} trained plainly for {config.warm_start_steps} steps on "
        f"{config.warm_start_docs} documents disjoint from the continual-pretraining slice"
    )
    student = timed("warm-start", warm_start_done(config), make_warm_start, config, stage2)
    corpus = write_corpus_slice(config.out / "corpus" / "train.jsonl", config.train_docs)
    log(f"stage 1: scoring {config.train_docs} documents with the teacher")
    cache = timed("stage1", cache_done(config), score_with_ray, config, manifest, teacher, corpus)
    arms = {}
    for arm in config.arms:
        log(f"stage 2: training arm --guidance {arm} with torchrun x{config.nproc_per_node}")
        arms[arm] = timed(
            f"stage2-{arm}", arm_done(config, arm), train_arm, config, manifest, cache, student, arm
        )
    models = {"warm-start": student}
    models.update({arm: out / "final" for arm, out in arms.items()})
    evaluated = all(eval_path(config, name).exists() for name in models)
    results = timed("eval", evaluated, evaluate_models, config, eval_settings, models)
    inspect_guided_arm(config, stage2, cache, arms)
    report = write_report(config, manifest, teacher, cache, arms, results, timings, prereg)
    log(f"done: {report}")
    return report
