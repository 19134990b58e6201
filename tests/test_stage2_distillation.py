"""Stage 2 `--guidance uld` and `--guidance kld` end to end (in-process, one rank, tiny Llama
student on the real tinyllama tokenizer) from caches with the teacher's top-k: they train
cross-entropy plus lambda x their term (checked on the gradient of step 1's objective against an
independent computation), a stopped and resumed run is bit-identical, and the refusals are one
line each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.cache import topk_codec
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation.topk import IDS, PROBS, REST
from pipeline.tokenizer import load_tokenizer
from stage2_train import forward as student_forward
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import read_metrics, train_args


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """Top-8 caches scored with the student's own tokenizer (KLD's case) and with another one."""
    root = tmp_path_factory.mktemp("caches")
    paths = {name: root / name for name in ("same", "other", "plain")}
    for encoding in ("float16", "compact"):  # the same distributions, stored each way
        suffix = "" if encoding == "float16" else "-compact"
        paths["same" + suffix], paths["other" + suffix] = root / f"same{suffix}", root / f"other{suffix}"
        build_cache(paths["same" + suffix], teacher_tokenizer="tinyllama", num_documents=16,
                    topk=8, topk_encoding=encoding)  # fmt: skip
        build_cache(paths["other" + suffix], teacher_tokenizer="qwen2.5", num_documents=16,
                    topk=8, topk_encoding=encoding)  # fmt: skip
    build_cache(paths["plain"], teacher_tokenizer="qwen2.5", num_documents=16)
    return paths


# One micro-batch per step; in-process data (the resume test below uses 2 workers)
ARGS = ("--num-workers", "0", "--global-batch-tokens", "64", "--max-steps", "3")
# 2 workers, one micro-batch per step: a stop at step 3 leaves the other worker next in turn
RESUME_ARGS = ("--num-workers", "2", "--global-batch-tokens", "64")
CASES = [("uld", "other"), ("kld", "same")]
WEIGHTS = {"uld": 0.5, "kld": 1.0}  # --uld-lambda's default; KLD's fixed weight (eq. 5)


def distill_losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["distill_loss"] for line in lines]


@dataclass(frozen=True)
class Run:
    """A finished run and its step 1 (one micro-batch, before any update): the micro-batch, the
    student's logits and the gradient of the step's objective with respect to those logits
    (the objective reaches the weights through them alone)."""

    out: Path
    batch: dict[str, torch.Tensor]
    logits: torch.Tensor
    grad: torch.Tensor


def train_watching_step_1(argv: list[str]) -> Run:
    """`main(argv)` in-process, with a hook on the logits of the trainer's first forward pass."""
    seen = {}
    forward = student_forward.student_logits

    def watched(model, batch, device):
        logits = forward(model, batch, device)
        if not seen:
            seen.update(batch=batch, logits=logits.detach().clone())
            logits.register_hook(lambda grad: seen.setdefault("grad", grad.clone()))
        return logits

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(student_forward, "student_logits", watched)
        assert main(argv) == 0
    out = Path(argv[argv.index("--out") + 1])
    return Run(out, seen["batch"], seen["logits"], seen["grad"])


def uld_by_definition(student, teacher, rest):
    """docs/distillation.md: the sorted student's top K against the teacher's, plus the rests."""
    top = student.sort(dim=-1, descending=True).values[:, : teacher.shape[-1]]
    return (top - teacher).abs().sum(-1) + (1 - top.sum(-1) - rest).abs()


def kld_by_definition(student, teacher, rest, ids):
    """KL(student || teacher) over the teacher's K ids and one bucket for every other id, the
    teacher's buckets floored at float16's smallest step (2^-24) and renormalized."""
    teacher, rest = teacher.clamp(min=2.0**-24), rest.clamp(min=2.0**-24)
    total = teacher.sum(-1) + rest
    picked = student.gather(-1, ids)
    other = 1 - picked.sum(-1)
    ids_term = (picked * (picked * total[:, None] / teacher).log()).sum(-1)
    return ids_term + other * (other * total / rest).log()


def gradients_by_definition(run: Run, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """With respect to step 1's logits: the gradient of the mean cross-entropy over the valid
    targets and that of the term's mean over the targets paired with a teacher distribution."""
    logits = run.logits.detach().requires_grad_()
    labels = run.batch["labels"]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    paired = (labels != IGNORE_INDEX) & ~run.batch[PROBS][..., 0].isnan()
    student = torch.softmax(logits[paired], dim=-1)
    teacher, rest = run.batch[PROBS][paired].float(), run.batch[REST][paired].float()
    if mode == "uld":
        term = uld_by_definition(student, teacher, rest)
    else:
        term = kld_by_definition(student, teacher, rest, run.batch[IDS][paired].long())
    ce_grad, term_grad = (
        torch.autograd.grad(loss, logits, retain_graph=True)[0] for loss in (ce, term.mean())
    )
    return ce_grad, term_grad


def assert_objective_is_ce_plus(weight: float, arm: Run, plain: Run, mode: str) -> None:
    """The arm's step-1 gradient is `none`'s plus weight x the term's, and `none`'s is the
    cross-entropy's. Tolerances: the difference of two float32 gradients carries a few ulps of
    the larger cross-entropy entries (4 eps x their largest); rtol covers the term's other
    formulation in the product (torch.topk and log Z read from the cross-entropy)."""
    ce_grad, term_grad = gradients_by_definition(arm, mode)
    atol = 4 * torch.finfo(torch.float32).eps * ce_grad.abs().max().item()
    assert (weight * term_grad).abs().max() > 100 * atol  # or the check below would be blind
    torch.testing.assert_close(plain.grad, ce_grad, rtol=1e-5, atol=atol)
    torch.testing.assert_close(arm.grad - plain.grad, weight * term_grad, rtol=1e-3, atol=atol)


@pytest.fixture(scope="module")
def runs(caches, tmp_path_factory) -> dict[tuple[str, str], Run]:
    runs = {}
    for mode, cache in [*CASES, ("none", "other"), ("none", "same")]:
        out = tmp_path_factory.mktemp(f"{mode}-{cache}") / "out"
        runs[mode, cache] = train_watching_step_1(
            train_args(caches[cache], out, *ARGS, "--guidance", mode)
        )
    return runs


@pytest.mark.parametrize(("mode", "cache"), CASES)
def test_a_compact_cache_trains_on_what_the_float16_one_holds_within_its_error(
    mode, cache, caches, runs, tmp_path
):
    """The compact encoding (the default of new caches) gives the trainer the same ids and each
    probability within the codec's relative error of the float16 cache's (both float16 in the
    micro-batch), so the first step's term moves by at most what that error allows: ULD by its
    weight times the error (the term is Lipschitz in each probability), KLD by half a step of
    log-probability."""
    compact = train_watching_step_1(
        train_args(caches[cache + "-compact"], tmp_path / "out", *ARGS, "--guidance", mode)
    )
    plain = runs[mode, cache]
    ours, theirs = compact.batch[PROBS].float(), plain.batch[PROBS].float()
    assert (ours.isnan() == theirs.isnan()).all()
    scored = ~theirs.isnan()
    tolerance = topk_codec.RELATIVE_ERROR + 2 * 2.0**-11  # and a float16 rounding each side
    assert ((ours[scored] / theirs[scored] - 1).abs() <= tolerance).all()
    if mode == "kld":
        assert torch.equal(compact.batch[IDS], plain.batch[IDS])
    first, reference = distill_losses(compact.out)[0], distill_losses(plain.out)[0]
    bound = WEIGHTS[mode] * tolerance if mode == "uld" else topk_codec.STEP
    assert 0 < abs(first - reference) <= bound, (first, reference)


def assert_step_1_is_ce_plus(weight: float, term, logits, arm: Run, plain: Run) -> None:
    """The logged term is `term` (computed by hand from `logits`, which require grad), and the
    arm's step-1 gradient is the cross-entropy's plus weight x the term's (tolerances as in
    assert_objective_is_ce_plus)."""
    labels = arm.batch["labels"]
    assert distill_losses(arm.out)[0] == pytest.approx(term.detach().item(), rel=1e-5)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    ce_grad, term_grad = (
        torch.autograd.grad(loss, logits, retain_graph=True)[0] for loss in (ce, term)
    )
    atol = 4 * torch.finfo(torch.float32).eps * ce_grad.abs().max().item()
    assert term_grad.abs().max() > 100 * atol
    torch.testing.assert_close(plain.grad, ce_grad, rtol=1e-5, atol=atol)
    torch.testing.assert_close(arm.grad - plain.grad, weight * term_grad, rtol=1e-3, atol=atol)


def test_kld_sampled_trains_cross_entropy_plus_the_estimate_of_the_full_kl(runs, tmp_path):
    """`--guidance kld-sampled` on a sampled cache (`--topk-mode sampled`) of the student's own
    tokenizer: step 1's term is the estimate of the forward KL(teacher || student) at the cached
    draws (pipeline.distillation.sampled), and its gradient is the cross-entropy's plus that
    estimate's."""
    from pipeline.distillation.sampled import DRAWN_IDS, DRAWN_LOGPROBS

    cache = tmp_path / "sampled"
    build_cache(cache, teacher_tokenizer="tinyllama", num_documents=16, topk=8, topk_mode="sampled")
    arm = train_watching_step_1(
        train_args(cache, tmp_path / "out", *ARGS, "--guidance", "kld-sampled")
    )
    plain = runs["none", "same"]
    logits = arm.logits.detach().requires_grad_()
    labels = arm.batch["labels"]
    ids = arm.batch[DRAWN_IDS].long()
    paired = (labels != IGNORE_INDEX) & (ids[..., 0] >= 0)
    assert paired.sum() > 20
    student = torch.log_softmax(logits[paired], -1).gather(-1, ids[paired])
    term = (arm.batch[DRAWN_LOGPROBS][paired].float() - student).mean(-1).mean()  # by hand
    assert_step_1_is_ce_plus(1.0, term, logits, arm, plain)


def test_uld_sampled_trains_cross_entropy_plus_the_estimate_of_the_full_distance(runs, tmp_path):
    """`--guidance uld-sampled` on a sampled cache of a teacher with another, larger vocabulary
    (qwen2.5's, 151,665 ids, against the student's 32,000): step 1's term is the estimate at the
    cached draws' ranks against the student's whole sorted distribution (a rank beyond the
    student's vocabulary reads 0), its gradient the cross-entropy's plus lambda x the
    estimate's; the chunked pass trains the same run."""
    from pipeline.distillation.sampled import DRAWN_LOGPROBS, DRAWN_RANKS

    cache = tmp_path / "sampled"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=16, topk=8, topk_mode="sampled")
    args = train_args(cache, tmp_path / "out", *ARGS, "--guidance", "uld-sampled")
    arm = train_watching_step_1(args)
    plain = runs["none", "other"]
    logits = arm.logits.detach().requires_grad_()
    labels, ranks = arm.batch["labels"], arm.batch[DRAWN_RANKS].long()
    paired = (labels != IGNORE_INDEX) & (ranks[..., 0] >= 0)
    assert paired.sum() > 20
    student = torch.softmax(logits[paired], -1).sort(dim=-1, descending=True).values
    student = F.pad(student, (0, 151_665 - student.shape[-1]))  # ULD pads the shorter with 0
    teacher = arm.batch[DRAWN_LOGPROBS][paired].float().exp()
    at_rank = student.gather(-1, ranks[paired])
    term = ((at_rank - teacher).abs() / teacher).mean(-1).mean()  # by hand, no mass beyond V_t
    assert_step_1_is_ce_plus(0.5, term, logits, arm, plain)
    chunked = tmp_path / "chunked"
    args = train_args(cache, chunked, *ARGS, "--guidance", "uld-sampled", "--loss-kernel", "chunked")
    assert main(args) == 0
    for ours, theirs in zip(distill_losses(chunked), distill_losses(arm.out), strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5)


def test_a_sampled_cache_without_its_head_size_is_refused_for_uld_sampled(tmp_path, capsys):
    """A sampled cache scored before it recorded the teacher's head size: one line, no run."""
    from dataclasses import replace

    from pipeline.cache.manifest import load_manifest, write_manifest

    cache = tmp_path / "sampled"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=16, topk=8, topk_mode="sampled")
    manifest = load_manifest(cache)
    write_manifest(cache, replace(manifest, settings=replace(manifest.settings, sample_head_size=None)))
    out = tmp_path / "out"
    assert main(train_args(cache, out, "--guidance", "uld-sampled")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stage2_train/train.py: error: ") and "\n" not in err
    assert "needs the teacher's head size, which this sampled cache does not record" in err
    assert not out.exists() or not (out / "checkpoints").exists()


@pytest.mark.parametrize(("mode", "cache"), CASES)
def test_the_arm_trains_cross_entropy_plus_its_term(mode, cache, runs):
    arm, plain = runs[mode, cache], runs["none", cache]
    # step 1 sees the same data and weights as `none` (the same computation: exactly equal)
    assert torch.equal(arm.logits, plain.logits)
    assert torch.equal(arm.batch["labels"], plain.batch["labels"])
    ours = read_metrics(arm.out)
    assert ours[0]["loss_all"] == read_metrics(plain.out)[0]["loss_all"]
    # every token kept, and the objective is cross-entropy + weight x the term
    assert all(r["kept_fraction"] == 1.0 and r["loss"] == r["loss_all"] for r in ours)
    assert_objective_is_ce_plus(WEIGHTS[mode], arm, plain, mode)
    terms = distill_losses(arm.out)
    assert len(terms) == 3 and all(0 < t < 10 for t in terms)
    saved = json.loads((arm.out / "config.json").read_text())
    assert saved["guidance"] == mode and saved["uld_lambda"] == 0.5


def test_uld_lambda_weights_the_term(caches, runs, tmp_path):
    args = train_args(caches["other"], tmp_path / "out", *ARGS, "--guidance", "uld")
    heavier = train_watching_step_1([*args, "--max-steps", "2", "--uld-lambda", "1.5"])
    default, plain = runs["uld", "other"], runs["none", "other"]
    assert torch.equal(heavier.logits, default.logits)
    # with the default's 0.5 (the test above), the gradient is cross-entropy's + lambda x the term's
    assert_objective_is_ce_plus(1.5, heavier, plain, "uld")
    assert distill_losses(heavier.out)[0] == distill_losses(default.out)[0]  # unweighted term
    assert json.loads((heavier.out / "config.json").read_text())["uld_lambda"] == 1.5


@pytest.mark.parametrize(("mode", "cache"), CASES)
def test_the_chunked_pass_trains_what_the_full_logits_do(mode, cache, caches, runs, tmp_path):
    """--loss-kernel chunked (auto's choice on a GPU): the term read from the chunked pass
    (the student's top k or the teacher ids' logits, log Z) trains the run the plain pass
    trains, step by step within float32 rounding."""
    out = tmp_path / "chunked"
    args = train_args(caches[cache], out, *ARGS, "--guidance", mode, "--loss-kernel", "chunked")
    assert main(args) == 0
    assert json.loads((out / "config.json").read_text())["resolved_loss_kernel"] == "chunked"
    plain = runs[mode, cache].out
    for ours, theirs in zip(read_metrics(out), read_metrics(plain), strict=True):
        for key in ("loss", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (key, ours, theirs)
    for ours, theirs in zip(distill_losses(out), distill_losses(plain), strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "cache"), CASES)
def test_stopped_and_resumed_run_is_bit_identical(mode, cache, caches, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(train_args(caches[cache], whole, *RESUME_ARGS, "--guidance", mode)) == 0
    args = train_args(caches[cache], parts, *RESUME_ARGS, "--guidance", mode)
    assert main([*args, "--stop-at-step", "3"]) == 0
    assert main(args) == 0
    assert read_metrics(parts) == read_metrics(whole)  # floats compared exactly
    assert distill_losses(parts) == distill_losses(whole)
    assert (parts / "final" / "model.safetensors").read_bytes() == (
        whole / "final" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("mode", "cache", "message"),
    [
        ("kld", "other", "--guidance kld compares the teacher's and the student's probabilities"),
        ("uld", "plain", "reads the teacher's topk_probs, topk_rest, which cache"),
        ("kld", "plain", "stage 1's --topk-probs K and --topk-probs K without --no-topk-ids"),
        ("uld-sampled", "other", "reads the teacher's sample_logprobs, sample_ranks, which"),
    ],
)
def test_a_cache_the_arm_cannot_use_is_refused_in_one_line(
    mode, cache, message, caches, tmp_path, capsys
):
    out = tmp_path / "out"
    assert main(train_args(caches[cache], out, "--guidance", mode)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stage2_train/train.py: error: ") and "\n" not in err
    assert message in err
    assert not (out / "checkpoints").exists()


def test_a_refusal_says_what_the_cache_holds_and_names_its_tokenizer(caches, tmp_path, capsys):
    """Before: a sampled cache under `uld` was told to "score with --topk-probs K" (it was), and
    a cache scored with its teacher's own tokenizer was said to have "tokenizer None"."""
    sampled = tmp_path / "sampled"
    build_cache(sampled, num_documents=4, docs_per_shard=4, topk=8, topk_mode="sampled")
    assert main(train_args(sampled, tmp_path / "out", "--guidance", "uld")) == 2
    err = capsys.readouterr().err
    assert (
        "(it holds 8 sampled draws a position: --topk-mode sampled): score the corpus with stage "
        "1's --topk-probs K --topk-mode top, or train from it with --guidance kld-sampled or "
        "uld-sampled"
    ) in err
    assert main(train_args(caches["other"], tmp_path / "out", "--guidance", "kld")) == 2
    err = capsys.readouterr().err
    vocabulary = load_tokenizer("qwen2.5").vocab_size
    assert f"scored with its teacher's own tokenizer ({vocabulary:,} tokens)" in err
    assert "None" not in err


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "cache"), CASES)
def test_two_ranks_under_ddp_and_fsdp_train_the_same_term(mode, cache, caches, tmp_path):
    """2 gloo ranks (torchrun): the term's units and sums are all-reduced, so FSDP and DDP log
    the same losses and terms up to float summation order."""
    from tests.test_stage2_torchrun import finish, torchrun

    args = ("--guidance", mode, "--max-steps", "4", "--global-batch-tokens", "256")
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    launched = [
        torchrun(train_args(caches[cache], ddp, *args, "--num-workers", "1")),
        torchrun(train_args(caches[cache], fsdp, *args, "--num-workers", "1", "--fsdp")),
    ]
    for process in launched:
        finish(process)
    replicated, sharded = read_metrics(ddp), read_metrics(fsdp)
    assert [r["step"] for r in replicated] == [1, 2, 3, 4]
    for a, b in zip(sharded, replicated, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    for a, b in zip(distill_losses(fsdp), distill_losses(ddp), strict=True):
        assert a == pytest.approx(b, rel=1e-4) and 0 < a < 10
