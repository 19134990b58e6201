"""The regime experiment's steps (manifests/regime.toml, docs/regime.md): the seeded splits, the
teacher and one stage-1 cache of the continual-pretraining part, the teacher's evaluation on the
test part, a plain warm start trained until its plateau test passes, the regime gate, the
selection diagnostic, then every arm at each rate (seed 0), each arm's rate chosen on the
validation part, the other seeds at it, and the report. A rerun redoes nothing finished. The
GPU form (manifests/regime-gpu.toml) carries its cache and the teacher's evaluation from a CPU,
where a teacher_only run made them: no teacher runs on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from apps.demo.arms import (
    ArmRun,
    Tables,
    check_tables,
    selection_diagnostic,
    selection_done,
    train_arm,
)
from apps.demo.run import (
    StepTimings,
    cache_done,
    score_with_ray,
    teacher_folder,
    train_warm_start_of,
    warm_start_done,
)
from apps.evaluation.config import EvalConfig
from experiments.regime.config import ARMS, RegimeConfig, RegimePreRegistration
from experiments.regime.report import gate, write_regime_report
from pipeline.config import from_dict, load_manifest_section
from pipeline.errors import ConfigError
from pipeline.io import atomic_path, atomic_write_json, open_binary_stream
from pipeline.log import get_logger
from pipeline.shipped import CORPUS_SPLITS, shipped_corpus
from stage2_train.config import TrainConfig

log = get_logger("regime").info
PARTS = ("test", "validation", "cpt", "warm")


def check_design(config: RegimeConfig, manifest: Path) -> tuple[Tables, dict[str, dict]]:
    """Every table checked as its reader will check it, before anything runs (apps.demo.arms),
    each arm's stage-2 options its table in [arms] over [stage2]; and the arms' tables."""
    tables = load_manifest_section(manifest, ARMS)
    missing = [arm for arm in config.arms if not isinstance(tables.get(arm), dict)]
    if missing:
        raise ConfigError(f"{manifest}: no [arms.{missing[0]}] table for arm {missing[0]!r}")
    arms = {arm: tables[arm] for arm in config.arms}
    corpus = str(config.out / "corpus" / "cpt.jsonl")
    # each arm's max_steps is one pass over the corpus part, known once the splits are written;
    # a carried cache is checked for its chapters once they are, then by stage 2 for its columns
    tables = check_tables(config, manifest, corpus, arms, given={"max_steps": 1000},
                          prereg_type=RegimePreRegistration, arms_table=ARMS)  # fmt: skip
    return tables, arms


def write_splits(config: RegimeConfig) -> dict[str, Path]:
    """The corpus's lines in a seeded order, cut into the parts (test, validation, cpt, warm),
    each written as it came; `splits.json` lists each part's ids."""
    folder = config.out / "corpus"
    paths = {part: folder / f"{part}.jsonl" for part in PARTS}
    if all(path.exists() for path in paths.values()):
        return paths
    source = shipped_corpus(config.corpus) if config.corpus in CORPUS_SPLITS else config.corpus
    with open_binary_stream(source) as stream:
        lines = [line for line in stream if line.strip()]
    sizes = (config.test_docs, config.validation_docs, config.cpt_docs)
    if sum(sizes) >= len(lines):
        raise ConfigError(f"{source} has {len(lines)} documents: too few for test, validation "
                          f"and continual-pretraining parts of {sizes} and a warm start")  # fmt: skip
    order = np.random.default_rng(config.split_seed).permutation(len(lines))
    bounds = np.cumsum((0, *sizes, len(lines)))
    ids = {}
    for part, begin, end in zip(PARTS, bounds[:-1], bounds[1:], strict=True):
        chosen = [lines[i] for i in order[begin:end]]
        with atomic_path(paths[part]) as tmp:
            tmp.write_bytes(b"".join(line.rstrip(b"\n") + b"\n" for line in chosen))
        ids[part] = [json.loads(line).get("id", int(i)) for line, i in
                     zip(chosen, order[begin:end], strict=True)]  # fmt: skip
    atomic_write_json(folder / "splits.json", {"source": str(source), "seed": config.split_seed,
                                               "ids": ids})  # fmt: skip
    return paths


def texts_of(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def evaluate_on(config: RegimeConfig, settings: dict, model: Path, part: str, parts: dict,
                name: str) -> dict:  # fmt: skip
    """`vocagno eval` of `model` on a part's documents: bits per character, and on the test part
    the last-word accuracy too; kept at OUT/eval/NAME-PART.json."""
    from apps.evaluation.run import evaluate

    dest = config.out / "eval" / f"{name}-{part}.json"
    if not dest.exists():
        log(f"evaluating {name} on the {part} part")
        count = config.test_docs if part == "test" else config.validation_docs
        evaluate(from_dict(EvalConfig, {
            **settings, "model": str(model), "data": str(parts[part]), "num_docs": count,
            "answer_problems": 0, "accuracy_problems": 0, "last_words": part == "test",
            "out": dest,
        }))  # fmt: skip
    return json.loads(dest.read_text())


def make_warm_start(config: RegimeConfig, stage2: TrainConfig, parts: dict) -> Path:
    from apps.demo.warm_start import PlateauStop

    if warm_start_done(config):
        return config.out / "warm-start"
    return train_warm_start_of(
        config, stage2, texts_of(parts["warm"]), steps=config.warm_start_max_steps,
        lr=config.warm_start_lr, min_lr=config.warm_start_lr,
        warmup_steps=config.warm_start_warmup, heldout=texts_of(parts["validation"]),
        heldout_every=config.heldout_every,
        plateau=PlateauStop(config.plateau_tolerance, config.plateau_every,
                            config.plateau_min_steps),
    )  # fmt: skip


def arm_steps(config: RegimeConfig, stage2: TrainConfig, parts: dict) -> int:
    """One pass over the continual-pretraining part: its student tokens (with each document's
    EOS) // the tokens of a step."""
    from pipeline.tokenizer import load_tokenizer

    encodings = load_tokenizer(config.student_tokenizer).encode_batch(
        texts_of(parts["cpt"]), add_eos=True
    )
    return sum(len(e.ids) for e in encodings) // stage2.optimizer.global_batch_tokens


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-seed{seed}"


def arm_model(config: RegimeConfig, manifest: Path, cache: Path, student: Path, arm: str,
              table: dict, lr: float, seed: int, max_steps: int) -> Path:  # fmt: skip
    """One arm's final model, trained at peak `lr` (min_lr a tenth of it), its table's options
    over [stage2] (apps.demo.arms.train_arm)."""
    options = {key: value for key, value in table.items() if key != "guidance"}
    run = ArmRun(run_name(arm, lr, seed), table["guidance"], seed=seed, lr=lr, min_lr=lr / 10,
                 max_steps=max_steps, options=options)  # fmt: skip
    return train_arm(config, manifest, cache, student, run) / "final"


def chosen_rate(config: RegimeConfig, settings: dict, parts: dict, arm: str) -> float:
    """The rate whose seed-0 model has the lower validation bits per character (first on a tie)."""
    values = {}
    for lr in config.rates:
        name = run_name(arm, lr, config.rate_seed)
        final = config.out / "arms" / name / "final"
        result = evaluate_on(config, settings, final, "validation", parts, name)
        values[lr] = result["bits_per_character"]["bits_per_character"]
    return min(config.rates, key=values.__getitem__)


def carried_cache(config: RegimeConfig, parts: dict) -> Path:
    """`cache`, made elsewhere, checked to be of this design's continual-pretraining part: its
    one source is that part's file, byte for byte as long (a cache of other chapters could hold
    test chapters)."""
    from pipeline.cache.manifest import load_manifest

    cache, cpt = Path(config.cache), parts["cpt"]
    sources = [(s.get("name"), s.get("bytes")) for s in load_manifest(cache).corpus["sources"]]
    if sources != [(cpt.name, cpt.stat().st_size)]:
        raise ConfigError(
            f"cache {cache} scored {sources}, not this design's continual-pretraining part "
            f"({cpt}, {cpt.stat().st_size:,} bytes): make it with this manifest and "
            '--teacher-only (docs/regime.md, "At GPU scale")'
        )
    return cache


def carried_teacher_eval(config: RegimeConfig, parts: dict) -> None:
    """`teacher_eval`, made elsewhere, checked to be of this design's test part (the same
    chapters in the same order: each one's scored characters, all of them for a tokenizer with a
    BOS or an EOS, as every shipped one has), kept where the report reads the teacher's."""
    source, test = Path(config.teacher_eval), parts["test"]
    try:
        result = json.loads(source.read_text())
        characters = result["bits_per_character"]["per_document_characters"]
        result["last_word_accuracy"]["accuracy"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"teacher_eval {source} is no `vocagno eval --last-words` result of "
                          f"the test part ({type(exc).__name__}: {exc}): make it with this "
                          "manifest and --teacher-only") from None  # fmt: skip
    if characters != [len(text) for text in texts_of(test)]:
        raise ConfigError(
            f"teacher_eval {source} evaluated {len(characters)} documents that are not this "
            f"design's {config.test_docs} test chapters ({test}): make it with this manifest "
            "and --teacher-only"
        )
    if source.resolve() != config.teacher_eval_path.resolve():
        atomic_write_json(config.teacher_eval_path, result)


def run_regime(config: RegimeConfig, manifest: Path) -> Path | None:
    (stage2, teacher_settings, prereg), arms = check_design(config, manifest)
    # A student is evaluated in windows of the length it trained on (half-overlapping), never
    # past it: its RoPE positions beyond seq_len were never trained. The teacher keeps [eval]'s.
    settings = {**teacher_settings, "max_length": stage2.data.seq_len}
    config.out.mkdir(parents=True, exist_ok=True)
    steps = StepTimings(config.out)
    parts = write_splits(config)
    # Made elsewhere (the GPU form: no teacher here), each checked before anything runs; a
    # teacher_only run makes them, whatever the manifest names for the run it makes them for.
    carried = not config.teacher_only
    cache = carried_cache(config, parts) if carried and config.cache else None
    if carried and config.teacher_eval:
        carried_teacher_eval(config, parts)
    if cache is None or not config.teacher_eval_path.exists():
        teacher = teacher_folder(config, steps)
        if cache is None:
            log(f"stage 1: scoring the {config.cpt_docs} continual-pretraining documents")
            cache = steps.timed("stage1", cache_done(config), score_with_ray, config, manifest,
                                teacher, parts["cpt"])  # fmt: skip
        steps.timed("eval-teacher", config.teacher_eval_path.exists(), evaluate_on, config,
                    teacher_settings, teacher, "test", parts, "teacher")  # fmt: skip
    if config.teacher_only:
        log(f"teacher only: {cache} and {config.teacher_eval_path} are made; the rest runs "
            f'where {config.out} is carried (docs/regime.md, "At GPU scale")')  # fmt: skip
        return None
    log(f"warm start: {config.student} until its plateau test passes "
        f"(at most {config.warm_start_max_steps} steps)")  # fmt: skip
    student = steps.timed("warm-start", warm_start_done(config),
                          make_warm_start, config, stage2, parts)  # fmt: skip
    for part in ("test", "validation"):
        done = (config.out / "eval" / f"warm-start-{part}.json").exists()
        steps.timed(f"eval-warm-start-{part}", done, evaluate_on, config, settings, student, part,
                    parts, "warm-start")  # fmt: skip
    verdict = gate(config, prereg)
    if not verdict["passed"]:
        log("the regime gate failed: no arm is trained (the report says why)")
        return write_regime_report(config, manifest, prereg, steps.seconds)
    steps.timed("selection", selection_done(config), selection_diagnostic, config, stage2, cache,
                student)  # fmt: skip
    max_steps = arm_steps(config, stage2, parts)
    log(f"arms: {max_steps} steps each (one pass over the continual-pretraining part)")
    for arm in config.arms:  # every arm at every rate, seed 0, then the rate it is compared at
        for lr in config.rates:
            name = run_name(arm, lr, config.rate_seed)
            done = (config.out / "eval" / f"{name}-validation.json").exists()
            steps.timed(name, done, lambda a=arm, r=lr, n=name: evaluate_on(
                config, settings, arm_model(config, manifest, cache, student, a, arms[a], r,
                                            config.rate_seed, max_steps),
                "validation", parts, n))  # fmt: skip
    for seed in config.seeds:
        for arm in config.arms:
            if seed not in config.seeds_of(arm):
                continue
            lr = chosen_rate(config, settings, parts, arm)
            name = run_name(arm, lr, seed)
            done = (config.out / "eval" / f"{name}-test.json").exists()
            steps.timed(f"{name}-test", done, lambda a=arm, r=lr, s=seed, n=name: evaluate_on(
                config, settings, arm_model(config, manifest, cache, student, a, arms[a], r, s,
                                            max_steps),
                "test", parts, n))  # fmt: skip
    return write_regime_report(config, manifest, prereg, steps.seconds)
