"""Several teachers' distillation terms in one run (--more-caches under --guidance uld/kld/...,
pipeline.distillation.teachers): the mixture reads the student's distribution once and is the
weighted sum of each teacher's own term over the weighted units, checked against every term
computed alone; the data path gives teacher i the extras its cache gives when read alone; two
caches of one teacher train as that teacher; --teacher-weights is saved and resumes exactly."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation.kld import TopkKLDistillation
from pipeline.distillation.teachers import TeacherMixture, mixture, teacher_key
from pipeline.distillation.topk import IDS, PROBS, REST
from pipeline.distillation.uld import UniversalLogitDistillation
from pipeline.errors import ConfigError
from pipeline.head_outputs import head_outputs
from stage2_train.config import parse_train_config
from stage2_train.data.documents import DocumentReader
from stage2_train.train import main
from tests.cache_fixtures import build_cache, corpus_documents
from tests.stage2_runs import read_metrics, train_args
from tests.test_several_teachers import plan_of

DOCUMENTS = corpus_documents(16)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """One corpus scored by two teachers with other tokenizers and top-k sizes (8 and 4), and a
    copy of the first (one teacher twice)."""
    root = tmp_path_factory.mktemp("teachers")
    build_cache(root / "qwen", teacher_tokenizer="qwen2.5", documents=DOCUMENTS, topk=8)
    build_cache(root / "smollm2", teacher_tokenizer="smollm2", documents=DOCUMENTS, topk=4,
                seed=1)  # fmt: skip
    shutil.copytree(root / "qwen", root / "qwen-copy")
    return {name: root / name for name in ("qwen", "smollm2", "qwen-copy")}


def teacher_extras(rng, shape, k, vocabulary, unpaired):
    """Random descending top-k distributions with their rest and ids; NaN / -1 where unpaired."""
    probs = np.sort(rng.dirichlet(np.ones(k + 1), size=shape)[..., :k], axis=-1)[..., ::-1]
    rest = 1 - probs.sum(-1)
    ids = np.stack([rng.permutation(vocabulary)[:k] for _ in range(int(np.prod(shape)))])
    ids = ids.reshape(*shape, k)
    probs[unpaired], rest[unpaired], ids[unpaired] = np.nan, np.nan, -1
    return {
        PROBS: torch.from_numpy(probs.astype(np.float16)),
        REST: torch.from_numpy(rest.astype(np.float16)),
        IDS: torch.from_numpy(ids.astype(np.int32)),
    }


@pytest.mark.parametrize("term", [UniversalLogitDistillation(), TopkKLDistillation()])
def test_the_mixture_is_the_weighted_sum_of_each_teachers_term_alone(term):
    """Teachers with top-8 and top-4 views pairing different tokens, weights 3:1: the mixture's
    sum over the weighted units is sum_i w_i S_i / sum_i w_i U_i with each S_i, U_i the term
    computed alone on its own reads of the student, values and gradients."""
    rng = np.random.default_rng(0)
    vocabulary, shape = 40, (2, 7)
    logits = torch.randn(*shape, vocabulary, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, vocabulary, shape)
    labels[0, 0] = IGNORE_INDEX
    unpaired = [rng.random(shape) < 0.2, rng.random(shape) < 0.4]
    own = [
        teacher_extras(rng, shape, k, vocabulary, u)
        for k, u in zip((8, 4), unpaired, strict=True)
    ]
    if term.name == "uld":
        own = [{name: e[name] for name in term.extra_names} for e in own]
    combined = mixture([term, term], [3.0, 1.0])
    assert isinstance(combined, TeacherMixture) and combined.weights == (0.75, 0.25)
    extras = {teacher_key(name, i): e[name] for i, e in enumerate(own) for name in e}
    assert set(combined.extra_names) == set(extras)

    student = head_outputs(logits, labels, combined.reads(extras, None))
    got = combined.loss_sum(student, labels, extras) / combined.units(labels, extras)
    (got_grad,) = torch.autograd.grad(got, logits)
    sums = [
        term.loss_sum(head_outputs(logits, labels, term.reads(e, None)), labels, e) for e in own
    ]
    units = [term.units(labels, e) for e in own]
    assert units[0] != units[1]  # the teachers pair different tokens
    expected = (0.75 * sums[0] + 0.25 * sums[1]) / (0.75 * units[0] + 0.25 * units[1])
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, check_dtype=False)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-8, check_dtype=False)


def test_one_term_is_itself_and_bad_weights_are_refused():
    term = UniversalLogitDistillation()
    assert mixture([term]) is term
    assert mixture([term, term]).weights == (0.5, 0.5)
    for weights in ([1.0], [1.0, 0.0], [1.0, -2.0]):
        with pytest.raises(ValueError, match="need 2 positive teacher weights"):
            mixture([term, term], weights)


def streamed_extras(plan) -> dict[str, dict[str, np.ndarray]]:
    """Each document's extras, per extra key, as one epoch of consumer 0 streams it."""
    found: dict[str, dict[str, np.ndarray]] = {}
    for docs, _, epoch in DocumentReader(plan, 0).documents():
        if epoch > 0:
            break
        cuts = np.cumsum(docs.lengths)[:-1]
        for name, values in docs.extras.items():
            for doc_id, part in zip(docs.doc_ids, np.split(values, cuts), strict=True):
                found.setdefault(doc_id, {})[name] = part
    return found


def test_each_teacher_gets_the_extras_its_cache_gives_alone(caches):
    """Read in step with the first cache, the second teacher's paired top-4 of every student
    token is what its cache gives when it is the only one (its own alignment and columns)."""
    uld = UniversalLogitDistillation()

    def plan(first, *more):
        return replace(plan_of(first, *more), distillation=mixture([uld] * (1 + len(more))))

    both = streamed_extras(plan(caches["qwen"], caches["smollm2"]))
    alone = {name: streamed_extras(plan(caches[name])) for name in ("qwen", "smollm2")}
    assert both.keys() == alone["qwen"].keys() and len(both) == len(DOCUMENTS)
    for doc_id, extras in both.items():
        for name in uld.extra_names:
            np.testing.assert_array_equal(extras[name], alone["qwen"][doc_id][name])
            np.testing.assert_array_equal(
                extras[teacher_key(name, 1)], alone["smollm2"][doc_id][name]
            )
        assert extras[teacher_key(PROBS, 1)].shape[1] == 4


def test_two_caches_of_one_teacher_train_as_that_teacher(caches, tmp_path):
    common = ("--guidance", "uld", "--num-workers", "0")
    assert main(train_args(caches["qwen"], tmp_path / "one", *common)) == 0
    two = (*common, "--more-caches", str(caches["qwen-copy"]), "--teacher-weights", "2", "1")
    assert main(train_args(caches["qwen"], tmp_path / "two", *two)) == 0
    one, both = (read_metrics_lines(tmp_path / name) for name in ("one", "two"))
    for a, b in zip(one, both, strict=True):
        for key in ("loss", "distill_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-6)


def test_two_teachers_weights_are_saved_and_resume_exactly(caches, tmp_path):
    common = ("--guidance", "uld", "--num-workers", "0", "--more-caches", str(caches["smollm2"]),
              "--teacher-weights", "3", "1")  # fmt: skip
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    assert main(train_args(caches["qwen"], whole, *common)) == 0
    assert json.loads((whole / "config.json").read_text())["teacher_weights"] == [3.0, 1.0]
    assert main(train_args(caches["qwen"], parted, *common, "--stop-at-step", "3")) == 0
    assert main(train_args(caches["qwen"], parted, *common)) == 0
    assert read_metrics(parted) == read_metrics(whole)
    plain = read_metrics_lines(whole)
    assert all(np.isfinite(r["distill_loss"]) and r["distill_loss"] > 0 for r in plain)
    # the GPU's loss path (row chunks of the head, never the logits) reads the merged top alike
    chunked = tmp_path / "chunked"
    assert main(train_args(caches["qwen"], chunked, *common, "--loss-kernel", "chunked")) == 0
    for a, b in zip(plain, read_metrics_lines(chunked), strict=True):
        for key in ("loss", "distill_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4)


def read_metrics_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_teacher_weights_outside_a_distillation_with_several_caches_are_refused(caches, tmp_path):
    more = ("--more-caches", str(caches["smollm2"]))
    for extra in (
        (*more, "--teacher-weights", "1", "1"),  # a selection mode
        ("--guidance", "uld", "--teacher-weights", "1"),  # one cache
        ("--guidance", "uld", *more, "--teacher-weights", "1", "2", "3"),
        ("--guidance", "uld", *more, "--teacher-weights", "1", "0"),
    ):
        with pytest.raises(ConfigError, match="takes one positive weight per cache"):
            parse_train_config(train_args(caches["qwen"], tmp_path, *extra))
