"""Stage 1's device-dependent choices, resolved in one place (pipeline/scoring/resolve.py): what
each `auto` becomes on a GPU and on a CPU (docs/stage1-gpu-path.md's table), what a worker whose
device differs from its driver's is told, and a scorer that loads nothing until asked to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import from_flat
from pipeline.errors import ConfigError
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked, check_worker, resolve
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import TeacherError, TeacherSource
from stage1_score.config import ScoreConfig

GPU, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_is_each_fast_path_on_a_gpu_and_the_plain_path_on_a_cpu():
    """Before the teacher is loaded (the driver's question): the device alone decides."""
    on_gpu, on_cpu = resolve(Asked(), GPU), resolve(Asked(), CPU)
    assert (on_gpu.device, on_gpu.dtype, on_gpu.unit_overlap) == ("cuda", "bfloat16", "on")
    assert on_gpu.switches == HeadSwitches(
        head_kernel="onepass", head_chunks="sized", row_packing="packed", attention="flex",
        batch_overlap="on", compile="layers",
    )  # fmt: skip
    assert (on_cpu.device, on_cpu.dtype, on_cpu.unit_overlap) == ("cpu", "float32", "off")
    assert on_cpu.switches == HeadSwitches(
        head_kernel="plain", head_chunks="fixed", row_packing="padded", attention=None,
        batch_overlap="off", compile="off",
    )  # fmt: skip
    assert on_gpu.head_rows is on_gpu.plain_head is None  # the teacher decides those
    # a sampled cache's draws need the plain head, in fixed chunks, on a GPU too
    sampled = resolve(Asked(), GPU, extras=HeadExtras(topk=4, sampled=True)).switches
    assert (sampled.head_kernel, sampled.head_chunks) == ("plain", "fixed")


def test_what_is_asked_for_stands_and_stage_1s_config_is_read_as_asked():
    config = from_flat(ScoreConfig, {
        "teacher": "t", "corpus": "c", "out": "o", "dtype": "float16", "unit_overlap": "on",
        "head_kernel": "fused", "row_packing": "packed", "attention": "dense",
    })  # fmt: skip
    resolved = resolve(Asked.of(config), CPU)
    assert (resolved.dtype, resolved.unit_overlap) == ("float16", "on")
    assert (resolved.switches.head_kernel, resolved.switches.row_packing) == ("fused", "packed")
    assert resolved.switches.attention == "dense"


def test_a_worker_that_would_load_another_dtype_than_the_identity_holds_is_refused():
    driver = resolve(Asked(), GPU)  # the cluster had GPUs: bfloat16 in the cache's identity
    check_worker(driver, resolve(Asked(), GPU))
    with pytest.raises(ConfigError, match=r"^--dtype auto: the driver resolved bfloat16 for "
                       r"workers on a cuda device, but a worker scores on a cpu device "
                       r"\(float32\); name --dtype$"):  # fmt: skip
        check_worker(driver, resolve(Asked(), CPU))


def test_a_scorer_loads_nothing_until_load(tmp_path: Path):
    """Made with what is asked (cheap: no teacher read); `load()` reads the teacher."""
    missing = TeacherSource(str(tmp_path / "none"), "folder", tmp_path / "none")
    scorer = HFScorer(missing, max_length=16, stride=6, batch_tokens=64, device="cpu")
    assert scorer.resolved is None
    with pytest.raises(TeacherError, match="cannot load teacher"):
        scorer.load()
