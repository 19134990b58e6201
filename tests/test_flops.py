"""MFU and tokens/s: the peak table by device name, the formula, and the per-step meter."""

from __future__ import annotations

import pytest

from pipeline.flops import StepRate, device_peak_flops, flop_parameters, mfu, peak_flops


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


def test_step_rate_counts_wall_time_since_the_previous_step_for_targets_and_slots(monkeypatch):
    clock = iter([10.0, 12.0, 12.5, 13.5])
    monkeypatch.setattr("pipeline.flops.time.monotonic", lambda: next(clock))
    rate = StepRate(1000, "cpu")
    assert rate.fields(150, 200) == {
        "tokens_per_second": pytest.approx(75.0),
        "mfu": None,
        "slot_tokens_per_second": pytest.approx(100.0),
        "slot_mfu": None,
    }
    assert rate.fields(200, 200)["tokens_per_second"] == pytest.approx(400.0)
    rate.peak = 1e6  # a device with a peak: MFU is 6 N x rate / peak for each count
    fields = rate.fields(1, 2)
    assert fields["mfu"] == pytest.approx(6 * 1000 * fields["tokens_per_second"] / 1e6)
    assert fields["slot_mfu"] == pytest.approx(2 * fields["mfu"])


@pytest.mark.parametrize("tied", [False, True])
def test_flop_parameters_leave_out_the_input_embedding_unless_it_is_the_head(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    body = sum(p.numel() for p in model.model.layers.parameters()) + 32  # + the final norm
    assert flop_parameters(model) == body + 1000 * 32  # the head's matrix, once
