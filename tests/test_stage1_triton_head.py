"""`--head-kernel onepass` on a CPU: its tests run in Triton's interpreter, in a process of their
own (tests/triton_interpreted.py: TRITON_INTERPRET=1 must be set before triton is imported, and
this process imports it without); here, without the interpreter, it is refused in one line, and
its kernel is compiled for the GPUs it is meant for (benchmarks/triton_head_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import resolve_teacher
from tests.stage1_helpers import make_tiny_teacher

# CUDA builds of torch bring triton, and `make test`'s vLLM lock does here
pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.parametrize("marks", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_the_triton_kernel_in_tritons_interpreter(marks):
    """The interpreted tests this suite's marks select (`make test-all` runs both halves)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks]
    run = subprocess.run(
        [*command, "tests/triton_interpreted.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    said = run.stdout + run.stderr
    assert run.returncode == 0, said
    assert " passed" in said and " skipped" not in said, said


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter is on")
def test_without_cuda_or_the_interpreter_onepass_is_refused_in_one_line(tmp_path):
    teacher = resolve_teacher(str(make_tiny_teacher(tmp_path / "t", "smollm2")))
    with pytest.raises(ConfigError, match=r"^--head-kernel onepass: Triton compiles for CUDA "
                       r"devices, not cpu; .*TRITON_INTERPRET=1 .*; use --head-kernel fused$"):  # fmt: skip
        HFScorer(teacher, max_length=16, stride=6, batch_tokens=64, device="cpu",
                 asked=Asked("float32", HeadSwitches(head_kernel="onepass"))).load()  # fmt: skip


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter is on")
def test_auto_takes_fused_with_one_warning_where_onepass_cannot_run(tmp_path, monkeypatch, capsys):
    """`--head-kernel auto` on a GPU is onepass; where its kernel cannot run there (no triton, a
    failed compile or check at load) the worker scores with fused, says so in one warning, and
    records fused. Here auto is made to mean onepass on this CPU, where Triton does not run."""
    import pipeline.scoring.resolve as resolve
    from pipeline.log import configure

    choose = resolve.on_device
    monkeypatch.setattr(resolve, "on_device", lambda choice, device, gpu, cpu: choose(
        choice, device, gpu, gpu if gpu == "onepass" else cpu
    ))  # fmt: skip
    teacher = resolve_teacher(str(make_tiny_teacher(tmp_path / "t", "smollm2")))
    settings = dict(max_length=16, stride=6, batch_tokens=64, device="cpu")
    configure()
    scorer = HFScorer(teacher, asked=Asked("float32", HeadSwitches(head_kernel="auto")), **settings).load()
    assert scorer.switches.head_kernel == "fused" and scorer.describe()["head_kernel"] == "fused"
    said = capsys.readouterr().err
    assert said.count("[scoring] --head-kernel auto takes fused: --head-kernel onepass: Triton "
                      "compiles for CUDA devices, not cpu") == 1, said  # fmt: skip
    with pytest.raises(ConfigError, match="^--head-kernel onepass: "):  # asked for: refused
        HFScorer(teacher, asked=Asked("float32", HeadSwitches(head_kernel="onepass")), **settings).load()


def test_the_row_kernel_compiles_to_full_vector_loads_without_spills():
    """onepass is worth something only if its one read of the logits runs at the memory's speed:
    compiled for an H100/H200 and an A100, the row kernel loads the logits 16 bytes at a time
    and spills no register, with the space column and with the top k's block maxima."""
    from triton_head_compile import compile_rows

    for arch in (90, 80):
        for space, maxima in ((False, False), (True, False), (False, True)):
            compiled = compile_rows(arch, space, maxima)
            assert compiled.load_bytes == 16 and compiled.spill_bytes == 0, (arch, maxima, compiled)


def test_the_row_kernel_takes_each_exponential_in_two_instructions():
    """Where memory does not bound the row kernel, the instructions it issues per logit do (the
    head bench put its space column at half its loss's reduction time, runs 8 and 12). Compiled
    for an H100/H200 and an A100, each logit's exponential is one FMA and one MUFU.EX2, without
    ex2's fix-up for results below float32's smallest normal (a compare and two multiplies), and
    the loop stays under 10 instructions a logit for the loss, 16 with the space column and 12
    with the top k's block maxima; the natural exponentials of runs 7-15 took 13.7, 19.2, 15.4."""
    from triton_head_compile import compile_rows

    for arch in (90, 80):
        for space, maxima, most in ((False, False, 10), (True, False, 16), (False, True, 12)):
            compiled = compile_rows(arch, space, maxima)
            said = (arch, space, maxima, compiled.per_logit(), compiled.loop)
            assert compiled.per_logit("MUFU.EX2") < 1.1, said  # one a logit, one for the rescale
            assert compiled.per_logit("FSETP.GEU.AND") == 0, said
            assert compiled.per_logit() < most, said
        assert compile_rows(arch, True, natural_exp=True).per_logit() > 16


def test_the_kernel_says_how_it_rounds_its_sums_not_tritons_default():
    """Whether a multiply and an add fuse into one rounding moves the kernel's sums, so a cache's
    last bits; Triton 3.10 turns its default off. Compiled with the options a launch passes, the
    kernel says it (Triton warns where a compile leaves it to the default)."""
    from triton_head_compile import compile_rows

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        compile_rows(90, True)
    assert not [w for w in said if "FP_FUSION" in str(w.message)], [str(w.message) for w in said]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter is on")
@pytest.mark.parametrize("space", [False, True])
def test_one_compile_of_the_kernel_serves_batches_of_every_size(monkeypatch, space):
    """Triton compiles a kernel again for each new specialization of its arguments (an integer's
    divisibility by 16, a pointer's 16-byte alignment), and a unit's batches have any number of
    scored positions: launched as the scorer launches it, for every count up to 40 and chunks
    of the head's targets at any offset, the kernel specializes one way (and one more with the
    top k's block maxima), so that its compile at load serves every batch. Before, onepass's row kernel compiled a third variant in a worker's
    first unit with a count of 2 mod 4 (103 ms on an H200, run 11)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    from pipeline.scoring import triton_head
    from pipeline.scoring.head_kernels import TOPK_BLOCK

    class Launches:
        """A kernel's launches, as the specializations Triton's binder gives them."""

        def __init__(self, kernel):
            self.keys = set()
            self.bind = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _, specialization, options = self.bind(*args, **kwargs)
                assert options.get("enable_fp_fusion") is True, options  # not Triton's default
                self.keys.add(f"{specialization} {sorted(options.items())}")

            return launch

    vocab = 4096
    mask = torch.zeros(vocab, dtype=torch.int8) if space else None
    for maxima in (False, True):  # with the top k's block maxima, a variant of its own
        rows = Launches(triton_head._row_sums)
        monkeypatch.setattr(triton_head, "_row_sums", rows)
        for count in range(1, 41):
            for offset in range(4):  # a chunk's targets begin anywhere in the batch's
                targets = torch.arange(offset + count)[offset:]
                logits = torch.randn(count, vocab, dtype=torch.bfloat16)
                block_maxima = torch.empty(count, vocab // TOPK_BLOCK) if maxima else None
                triton_head.logit_row_sums(logits, targets, mask, block_maxima)
        assert len(rows.keys) == 1, rows.keys
        monkeypatch.undo()
