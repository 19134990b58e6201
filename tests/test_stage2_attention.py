"""--attention: flex_attention's block mask against the dense [B, 1, T, T] mask.

PyTorch's flex_attention has no backward pass on the CPU, so the CPU proves its forward: every
document of a packed row gets the logits it has alone, and the whole batch's logits equal the
dense path's. Training with flex runs on a GPU (benchmarks/bench_gpu.py has its row); on a CPU it
is refused in one line, and a checkpoint resumes only under the attention it was trained with
(tests/test_stage2_train.py, beside its training runs).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.document_attention import FLEX
from pipeline.errors import ConfigError
from pipeline.tokenizer import load_tokenizer
from stage2_train.attention import CAST, student_logits, use_attention
from stage2_train.resolve import resolve_attention

CPU = torch.device("cpu")
# A 150-token row over two 128-token blocks: three documents, one across the block boundary,
# then padding (segment 0).
LENGTHS = (40, 70, 25)


def packed_row() -> dict:
    generator = torch.Generator().manual_seed(0)
    pad = 150 - sum(LENGTHS)
    segments = [s for s, n in enumerate(LENGTHS, 1) for _ in range(n)] + [0] * pad
    positions = [p for n in LENGTHS for p in range(n)] + [0] * pad
    return {
        "input_ids": torch.randint(3, 1000, (2, 150), generator=generator),
        "segment_ids": torch.tensor([segments, segments[::-1]]),  # two layouts
        "position_ids": torch.tensor([positions, positions[::-1]]),
    }


def test_flex_gives_each_packed_document_its_logits_alone_and_equals_dense():
    from pipeline.models.student import build_student

    model = build_student("llama-tiny", load_tokenizer("tinyllama"), seed=0, seq_len=256).eval()
    batch = packed_row()
    with torch.no_grad():
        dense = student_logits(model, batch, CPU)
        use_attention(model, "flex")
        assert model.config._attn_implementation == CAST[FLEX]
        flex = student_logits(model, batch, CPU)
        model.set_attn_implementation("sdpa")
        start = 0
        for length in LENGTHS:  # row 0, each document alone
            alone = model(input_ids=batch["input_ids"][:1, start : start + length]).logits[0]
            torch.testing.assert_close(flex[0, start : start + length], alone, rtol=1e-4, atol=1e-4)
            start += length
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    print(f"largest |flex - dense| logit: {(flex - dense).abs().max():.1e}")


def test_auto_is_flex_on_a_gpu_and_dense_on_a_cpu_where_flex_is_refused():
    assert resolve_attention("auto", torch.device("cuda")) == "flex"
    assert resolve_attention("auto", CPU) == resolve_attention("dense", CPU) == "dense"
    with pytest.raises(ConfigError, match="--attention flex trains on a GPU only"):
        resolve_attention("flex", CPU)


@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_q_k_and_v_reach_the_kernel_in_the_autocast_dtype(attention, monkeypatch):
    """Under bf16 autocast with float32 weights (a GPU run without --fsdp), q and k leave RoPE in
    float32 and v its projection in bf16: each kernel is handed all three in bf16, with and
    without the document mask. A spy stands in for the kernel (CPU autocast here; PyTorch has no
    flex backward on a CPU, and the spy needs none)."""
    import transformers.integrations.flex_attention as flex_module

    from pipeline.models.student import build_student

    received = []

    def spy(query, key, value, *args, **kwargs):
        received.append((query.dtype, key.dtype, value.dtype))
        return torch.zeros_like(query)  # [B, H, T, D], as both kernels return it

    if attention == "flex":
        monkeypatch.setattr(flex_module, "compile_friendly_flex_attention", spy)
    else:
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = build_student("llama-tiny", load_tokenizer("tinyllama"), seed=0, seq_len=256)
    use_attention(model, attention)
    packed = packed_row()
    stream = {"input_ids": packed["input_ids"]}  # --packing stream: no mask, no segment ids
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in (packed, stream):
            student_logits(model, batch, CPU)
    layers = model.config.num_hidden_layers
    assert received == [(torch.bfloat16,) * 3] * (2 * layers)
