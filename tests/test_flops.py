"""MFU and tokens/s: the peak table by device name, the formula, and the per-step meter."""

from __future__ import annotations

import pytest

from pipeline.flops import StepRate, device_peak_flops, mfu, peak_flops


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
        (None, None),
    ],
)
def test_peak_flops_by_device_name(name, tflops):
    peak = peak_flops(name)
    assert (peak is None) if tflops is None else peak == pytest.approx(tflops * 1e12)


def test_mfu_is_6n_for_training_and_2n_for_a_forward_and_none_without_a_peak():
    assert mfu(1_000_000_000, 50_000, 1e15) == pytest.approx(0.3)
    assert mfu(1_000_000_000, 50_000, 1e15, training=False) == pytest.approx(0.1)
    assert mfu(1_000_000_000, 50_000, None) is None
    assert device_peak_flops("cpu") is None


def test_step_rate_counts_wall_time_since_the_previous_step(monkeypatch):
    clock = iter([10.0, 12.0, 12.5])
    monkeypatch.setattr("pipeline.flops.time.monotonic", lambda: next(clock))
    rate = StepRate(1000, "cpu")
    assert rate.fields(200) == {"tokens_per_second": pytest.approx(100.0), "mfu": None}
    assert rate.fields(200)["tokens_per_second"] == pytest.approx(400.0)
