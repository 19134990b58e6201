"""bench_gpu.py's stage-2 floor: the fastest plain training loop of the same student on batches of
the same shape, with no data path, no selection and no document mask, to set the trainer's rates
against (issue 27). It takes what the trainer's GPU path takes on the device (compiled decoder
layers, the chunked loss, fused AdamW, bf16 autocast on a GPU; on a CPU what `auto` takes there)
and trains every position of random token ids."""

from __future__ import annotations

import time

import torch
from device_timing import synchronize

from pipeline.chunked_loss import chunked_token_loss
from pipeline.flops import device_peak_flops, flop_parameters, mfu
from pipeline.models.layers import compile_layers, resolve_compile
from pipeline.models.student import build_student
from pipeline.tokenizer import load_tokenizer


def floor_rate(
    student: str, seq_len: int, micro: int, accumulation: int, steps: int, device: torch.device
) -> tuple[float, float | None]:
    """(Target tokens/s, MFU) of the plain loop, timed over the last two thirds of `steps` (the
    first third compiles and warms up)."""
    model = build_student(student, load_tokenizer("tinyllama"), 0, seq_len).to(device)
    compile_layers(model, resolve_compile("auto", device), "the student")
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(3, model.config.vocab_size, (micro, seq_len), generator=generator).to(device)
        for _ in range(accumulation)
    ]
    head, decoder = model.get_output_embeddings().weight, model.get_decoder()
    warm = steps // 3
    for step in range(steps):
        if step == warm:
            synchronize(device)
            started = time.perf_counter()
        for ids in batches:
            with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
                hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
                loss = chunked_token_loss(hidden[:, :-1], head, ids[:, 1:]).mean()
            (loss / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    targets = (steps - warm) * accumulation * micro * (seq_len - 1)
    rate = targets / (time.perf_counter() - started)
    return rate, mfu(flop_parameters(model), rate, device_peak_flops(device))
