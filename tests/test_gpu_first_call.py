"""benchmarks/gpu_first_call.py, the first stage-2 call on a GPU machine, cannot rot: it runs here
at its tiny shape on the CPU (where `auto` takes every switch's plain value), and a machine that
lacks what stage 2 imports is told so in its first seconds."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_first_call  # noqa: E402


@pytest.mark.slow  # two stage-2 arms, the floor and flex compiled for the CPU: about 40 s
def test_the_first_call_prints_every_phase_at_a_tiny_shape(capsys):
    assert gpu_first_call.main(["--shape", "tiny", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    phases = [line.split("] ", 1)[1].split(":", 1)[0] for line in lines]
    assert phases[:-1] == ["versions", "flex dtypes", "cache", "token", "none", "floor"], lines
    said = "\n".join(lines)
    assert "torch 2." in said and "MISSING" not in said
    # the cast in the trainer's attention: flex receives bf16 q, k and v under bf16 autocast
    assert "flex dtypes: q, k, v [('bfloat16', 'bfloat16', 'bfloat16')]" in said
    for arm in ("token", "none"):
        line = next(line for line in lines if f"] {arm}: " in line)
        assert "attention dense, compile off" in line and "loss_kernel plain" in line, line
        assert "0 graphs compiled, recompile limit hit 0 times, 0 graph breaks" in line, line
        assert re.search(r"first step [.\d]+ s;", line) and "losses finite" in line, line
        assert re.search(r"[,\d]+ target tokens/s, MFU n/a", line), line
    assert re.search(r"token / none [.\d]+, token / floor [.\d]+ \(llama-tiny, 3 steps", said)


def test_a_machine_without_what_stage_2_imports_is_told_at_once(monkeypatch, capsys):
    monkeypatch.setattr(gpu_first_call, "REQUIRED", (*gpu_first_call.REQUIRED, "not_a_package"))
    assert gpu_first_call.main(["--shape", "tiny"]) == 2
    said = capsys.readouterr().out
    assert "not_a_package MISSING (ModuleNotFoundError)" in said
    assert said.rstrip().endswith(
        "stopped: stage 2 imports not_a_package; install them and run again"
    )
