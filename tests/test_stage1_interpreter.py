"""benchmarks/bench_stage1_interpreter.py cannot rot: it runs here on a few short units, prints a
row per `--interpreter` setting, and leaves this process with Python's own switch interval."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_interpreter_bench_prints_both_settings_and_restores_the_switch_interval(capsys):
    import bench_stage1_interpreter

    before = sys.getswitchinterval()
    command = ["--docs", "20", "--units", "2", "--seconds", "0.3", "--repeats", "1"]
    assert bench_stage1_interpreter.main(command) == 0
    assert sys.getswitchinterval() == before
    out = capsys.readouterr().out
    for mode in ("default", "tuned"):
        row = re.search(
            rf"^{mode} +([\d,]+) +([\d.]+) +([\d.]+) +([\d.]+) ms +([\d.]+)$", out, re.M
        )
        assert row, out
        rate, share, waiting, _, units = (float(v.replace(",", "")) for v in row.groups())
        assert rate > 0 and share > 0 and 0 <= waiting <= 1 and units > 0, out
    assert "tuned / default, launches beside the host work: " in out
