"""A step's named sums (stage2_train/step.py) and the run's device-dependent decisions
(stage2_train/resolve.py), without training: the runs themselves are in test_stage2_train.py."""

from __future__ import annotations

import dataclasses

import torch

from pipeline.config import from_dict
from stage2_train.config import TrainConfig
from stage2_train.distributed import Runtime
from stage2_train.resolve import Resolved, first_difference, resolve
from stage2_train.step import StepSums

CPU = torch.device("cpu")


def test_each_sum_reaches_its_own_total_in_one_read():
    sums = StepSums.zeros(CPU)
    for value, name in enumerate(StepSums.names(), start=1):
        field = getattr(sums, name)
        field += value  # in place, as the step adds
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=CPU)
    totals = sums.read(runtime, torch.tensor(0.5))
    expected = {name: float(value) for value, name in enumerate(StepSums.names(), start=1)}
    assert dataclasses.asdict(totals) == {**expected, "grad_norm": 0.5}


def test_auto_takes_the_fast_paths_on_a_gpu_and_the_plain_ones_on_a_cpu():
    config = from_dict(TrainConfig, {"cache": "c", "student": "s", "out": "o", "max_steps": 10,
                                     "warmup_steps": 1})  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM

    student = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                                           num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    gpu = resolve(config, torch.device("cuda"), student)
    assert gpu == Resolved(attention="flex", adamw_kernel="fused", compile="layers",
                           loss_kernel="chunked", fsdp_param_dtype="float32", dtype="bfloat16",
                           pin_memory=True)  # fmt: skip
    cpu = resolve(config, CPU, student)
    assert cpu.saved() == {
        "resolved_attention": "dense",
        "resolved_adamw_kernel": "plain",
        "resolved_compile": "off",
        "resolved_loss_kernel": "plain",
        "resolved_fsdp_param_dtype": "float32",
        "resolved_dtype": "float32",
    }
    assert not cpu.pin_memory


def test_a_resume_computes_in_its_checkpoints_dtype_where_the_checkpoint_records_it():
    ours = {"resolved_attention": "dense", "resolved_dtype": "float32"}
    assert first_difference(ours, ours) is None
    assert first_difference({**ours, "resolved_dtype": "bfloat16"}, ours) == (
        "dtype", "bfloat16", "float32"
    )  # fmt: skip
    assert first_difference({"resolved_attention": "dense"}, ours) is None  # not recorded
    # a switch a checkpoint predates counts as its plain value
    assert first_difference({}, {**ours, "resolved_attention": "flex"}) == (
        "attention", "dense", "flex"
    )  # fmt: skip
