"""Every checked-in job manifest loads into the typed configs, and the paper's runs say what the
paper says (section 4.3 and appendix B)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.demo.config import DemoConfig, PreRegistration
from apps.evaluation.config import EvalConfig
from experiments.curve.config import CurveConfig
from experiments.dose.config import DoseConfig
from experiments.regime.config import ARMS, RegimeConfig, RegimePreRegistration
from pipeline.config import from_dict, load_manifest_section
from stage1_score.config import ScoreConfig
from stage2_train.config import TrainConfig

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
PAPER = sorted((MANIFESTS / "paper").glob("table1-*.toml"))
TABLE2 = sorted((MANIFESTS / "paper").glob("table2-*.toml"))
# Stage 2 settings the paper does not state: every paper manifest that sets one says so.
NOT_IN_PAPER = ("warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip")
SECTIONS = {
    "demo": DemoConfig,
    "curve": CurveConfig,
    "dose": DoseConfig,
    "regime": RegimeConfig,
    "preregistered": PreRegistration,
    "stage1": ScoreConfig,
    "stage2": TrainConfig,
    "eval": EvalConfig,
}
# Paths and inputs a manifest may leave to the command line.
PLACEHOLDERS = {
    "stage1": {"teacher": "t", "corpus": "c", "out": "o"},
    "stage2": {"cache": "c", "student": "s", "out": "o"},
    "eval": {"model": "m"},
}


def _tables(path: Path) -> dict[str, dict]:
    import tomllib

    return {name: load_manifest_section(path, name) for name in tomllib.loads(path.read_text())}


@pytest.mark.parametrize("path", sorted(MANIFESTS.rglob("*.toml")), ids=lambda p: p.name)
def test_manifest_tables_are_valid_configs(path):
    tables = _tables(path)
    # The regime experiment's arms have names of their own (rho1), each a table of stage-2
    # options over [stage2], and its comparisons name them; its runner sets max_steps.
    arms = tables.pop(ARMS, {})
    sections, placeholders = SECTIONS, PLACEHOLDERS
    if arms:
        sections = SECTIONS | {"preregistered": RegimePreRegistration}
        placeholders = PLACEHOLDERS | {"stage2": {**PLACEHOLDERS["stage2"], "max_steps": 1000}}
    assert tables and set(tables) <= set(sections), f"{path}: unknown tables {set(tables)}"
    for name, values in tables.items():
        from_dict(sections[name], {**placeholders.get(name, {}), **values}, f"{path} [{name}]")
    for arm, options in arms.items():
        stage2 = {**placeholders["stage2"], **tables.get("stage2", {}), **options}
        from_dict(TrainConfig, stage2, f"{path} [arms.{arm}]")


def test_there_is_one_manifest_per_table1_run():
    names = {p.stem.removeprefix("table1-") for p in PAPER}
    assert names == {
        "tinyllama-cpt", "tinyllama-cpt-teacher", "llemma-7b", "mistral-proxmath-7b",
        "deepseekmath-7b", "deepseekmath-7b-rl", "qwen2.5-math-7b", "qwen2.5-math-7b-instruct",
        # the logit-distillation baselines: KLD beside the same-vocabulary teachers, ULD beside
        # the others (Table 1, appendix B)
        "tinyllama-cpt-kld", "llemma-7b-kld", "mistral-proxmath-7b-uld", "deepseekmath-7b-uld",
        "deepseekmath-7b-rl-uld", "qwen2.5-math-7b-uld", "qwen2.5-math-7b-instruct-uld",
    }  # fmt: skip


@pytest.mark.parametrize(
    "path", [p for p in PAPER if p.stem.endswith(("-uld", "-kld"))], ids=lambda p: p.name
)
def test_uld_and_kld_rows_train_from_their_ours_rows_one_vllm_cache(path):
    """The 7B teacher scores the corpus once: vLLM stores the top 32 beside the losses, and the
    Ours row (`token`) and its logit-distillation baseline both train from that cache."""
    import re

    mode = path.stem[-3:]
    ours = path.with_name(re.search(r"\((table1-[^)]+\.toml)\)", path.read_text())[1])
    assert "stage1" not in _tables(path)  # no second scoring of the teacher
    stage1, stage2 = load_manifest_section(ours, "stage1"), load_manifest_section(path, "stage2")
    assert stage2["cache"] == stage1["out"] == load_manifest_section(ours, "stage2")["cache"]
    assert f"The cache is {ours.name}'s [stage1]" in path.read_text()
    assert stage1["backend"] == "vllm" and stage1["topk_probs"] == 32
    assert stage1["topk_ids"] is (mode == "kld")  # ULD compares ranks, not ids
    config = from_dict(TrainConfig, stage2)
    assert config.guidance.mode == mode and config.guidance.uld_lambda == 0.5  # appendix B
    assert config.guidance.distillation(config.model, {}).weight == (0.5 if mode == "uld" else 1.0)


def _scored_caches() -> dict[str, list[tuple[Path, ScoreConfig]]]:
    """Every manifest's [stage1] that names its `out`, by that cache."""
    scored: dict[str, list[tuple[Path, ScoreConfig]]] = {}
    for path in sorted(MANIFESTS.rglob("*.toml")):
        stage1 = _tables(path).get("stage1", {})
        if "out" in stage1:
            config = from_dict(ScoreConfig, {**PLACEHOLDERS["stage1"], **stage1}, str(path))
            scored.setdefault(str(config.output.out), []).append((path, config))
    return scored


def test_manifests_that_score_one_cache_score_it_alike():
    """Two manifests whose [stage1] writes one cache must ask for the same cache: a second,
    different one would be refused by stage 1 (or need --overwrite and break the first's runs)."""
    for out, scorers in _scored_caches().items():
        (first, config), *others = scorers
        for path, other in others:
            assert other == config, f"{path.name} and {first.name} score {out} differently"


def test_a_cache_another_manifest_scores_has_the_columns_the_reading_run_needs():
    """A [stage2] naming a cache that some manifest's [stage1] scores: that stage 1 stores what
    the guidance reads (the top-k for uld and kld, with the ids for kld; the space log-probability
    for alm)."""
    scored, checked = _scored_caches(), 0
    for path in sorted(MANIFESTS.rglob("*.toml")):
        stage2 = _tables(path).get("stage2", {})
        if stage2.get("cache") not in scored:
            continue
        (_, score), *_ = scored[stage2["cache"]]
        stage1 = score.output
        guidance, checked = stage2.get("guidance", "token"), checked + 1
        needs = {"uld": stage1.topk_probs > 0, "kld": stage1.topk_probs > 0 and stage1.topk_ids,
                 "alm": bool(stage1.space_logprob)}  # fmt: skip
        assert needs.get(guidance, True), f"{path.name}: {guidance} from {stage2['cache']}"
    assert checked >= len(PAPER) + len(TABLE2)


def test_the_plain_cpt_row_says_loudly_that_its_cache_is_another_runs():
    """TinyLlama-CPT trains no teacher, but stage 2 reads its documents from a cache: the cache
    it names is one a Table 1 manifest scores, and the file says so before anything else."""
    path = MANIFESTS / "paper" / "table1-tinyllama-cpt.toml"
    stage2 = load_manifest_section(path, "stage2")
    (scorer, _), *_ = _scored_caches()[stage2["cache"]]
    assert stage2["guidance"] == "none" and scorer.parent == path.parent
    top = path.read_text().splitlines()[:3]
    assert top[0].startswith("# !! CHANGE `cache`") and scorer.name in " ".join(top)


def test_tinyllama_cpt_is_also_a_teacher_scoring_with_the_plain_rows_checkpoint():
    """Table 1's "S + TinyLlama-CPT | Ours": stage 1 scores with the model the plain
    TinyLlama-CPT row trains, and the same vocabulary makes stage 2's alignment the identity."""
    plain = load_manifest_section(MANIFESTS / "paper" / "table1-tinyllama-cpt.toml", "stage2")
    teacher = MANIFESTS / "paper" / "table1-tinyllama-cpt-teacher.toml"
    assert plain["guidance"] == "none"
    assert load_manifest_section(teacher, "stage1")["teacher"] == f"{plain['out']}/final"
    assert load_manifest_section(teacher, "stage2")["guidance"] == "token"


def test_table2_has_every_chunk_row_and_its_random_control():
    rows = {
        (guidance.mode, guidance.num_chunks if "chunk" in guidance.mode else None)
        for guidance in (
            from_dict(TrainConfig, load_manifest_section(p, "stage2")).guidance for p in TABLE2
        )
    }
    chunked = {(mode, n) for mode in ("chunk", "random-chunk") for n in (8, 16, 32, 64)}
    assert rows == chunked | {("token", None)}
    for path in TABLE2:
        stage2 = from_dict(TrainConfig, load_manifest_section(path, "stage2"))
        optimizer, guidance = stage2.optimizer, stage2.guidance
        assert optimizer.max_steps * optimizer.global_batch_tokens == pytest.approx(5e9, rel=1e-3)
        assert (guidance.topk, guidance.aggregate, guidance.unmapped) == (0.4, "max", "include")
        assert str(stage2.data.cache).endswith("mistral-proxmath-7b")  # paper 6.1's teacher
        for world_size in (8, 32):  # one node, or the paper's 32 GPUs
            _data_plan(stage2.data.data_consumers, world_size)


@pytest.mark.parametrize("path", PAPER + TABLE2, ids=lambda p: p.name)
def test_paper_manifests_say_which_settings_are_not_from_the_paper(path):
    lines = path.read_text().splitlines()
    for name in NOT_IN_PAPER:
        (line,) = [line for line in lines if line.startswith(f"{name} =")]
        assert "not from the paper" in line, line
    stage2 = from_dict(TrainConfig, load_manifest_section(path, "stage2"))
    assert stage2.guidance.loss_normalization == "all"  # eq. 3


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_runs_use_the_papers_hyperparameters(path):
    stage2 = from_dict(TrainConfig, load_manifest_section(path, "stage2"))
    optimizer, guidance = stage2.optimizer, stage2.guidance
    assert stage2.model.student.startswith("TinyLlama/")
    assert (stage2.data.seq_len, optimizer.global_batch_tokens) == (2048, 2**21)
    assert (optimizer.lr, optimizer.min_lr) == (8e-5, 8e-6)
    assert optimizer.max_steps * optimizer.global_batch_tokens == pytest.approx(15e9, rel=1e-3)
    # the paper's 32 GPUs and the one 8-GPU node docs/stage2.md shows: the accumulation steps it
    # states, and the data stream split among either world's ranks (stage 2 refuses otherwise)
    assert (stage2.accumulation_steps(32), stage2.accumulation_steps(8)) == (4, 16)
    for world_size in (8, 32):
        _data_plan(stage2.data.data_consumers, world_size)
    if guidance.mode == "token":
        assert (guidance.topk, guidance.aggregate, guidance.unmapped) == (0.4, "max", "include")
        stage1 = load_manifest_section(path, "stage1")
        assert stage1["out"] == str(stage2.data.cache)
        assert stage1["corpus"] == "hf:open-web-math/open-web-math"


def _data_plan(consumers: int, world_size: int):
    """Stage 2's stream plan over a cache of a million documents, which checks the split."""
    from pipeline.cache.manifest import ShardRecord
    from stage2_train.data.plan import DataPlan

    shard = ShardRecord(0, "shard-00000.parquet", 10**6, 10**9, 1, "0" * 64)
    return DataPlan("c", (shard,), "s", 2048, 8, consumers=consumers, world_size=world_size)
