"""Stage 2's memory estimate (stage2_train/memory.py) counts the model, not only the activations:
for the paper's 1.1B student, float32 weights, gradients and AdamW's two moments are 17.6 GB
(16.4 GiB), on every rank under DDP and divided among the ranks under FSDP."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.models.student import PRESETS, build_student
from pipeline.tokenizer import load_tokenizer
from stage2_train.memory import StudentShape, estimate_memory

TINYLLAMA_PARAMETERS = 1_100_048_384  # TinyLlama-1.1B's published count, vocabulary 32,000
# The Table 1 manifests' micro-batch on one GPU: bfloat16 compute, FSDP-gathered in bfloat16.
ONE_GPU = dict(micro_batch_size=8, seq_len=2048, world_size=1, fsdp=False,
               compute_dtype="bfloat16", fsdp_param_dtype="float32", loss_kernel="chunked",
               activation_checkpointing=False)  # fmt: skip


@pytest.fixture(scope="module")
def tinyllama() -> StudentShape:
    """The tinyllama-1.1b preset's shape from its config alone (no weights, no memory)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=32000, max_position_embeddings=2048,
                         **PRESETS["tinyllama-1.1b"])  # fmt: skip
    return StudentShape.from_config(config)


def test_the_students_weights_gradients_and_adamw_state_are_16_bytes_a_parameter(tinyllama):
    assert tinyllama.parameters == TINYLLAMA_PARAMETERS
    assert (tinyllama.hidden_size, tinyllama.layers, tinyllama.vocab_size) == (2048, 22, 32000)
    estimate = estimate_memory(tinyllama, **ONE_GPU)
    assert estimate.model_state == 16 * TINYLLAMA_PARAMETERS == 17_600_774_144  # 16.39 GiB
    assert "16.4 GiB of float32 weights, gradients and AdamW moments" in estimate.parts()
    # bfloat16 autocast keeps a bfloat16 copy of each weight until its backward
    assert estimate.compute_copies == 2 * TINYLLAMA_PARAMETERS
    # the model's part does not depend on the micro-batch; the activations grow with it
    plain = estimate_memory(tinyllama, **{**ONE_GPU, "loss_kernel": "plain"})
    half = estimate_memory(tinyllama, **{**ONE_GPU, "loss_kernel": "plain", "micro_batch_size": 4})
    assert (half.model_state, half.compute_copies) == (plain.model_state, plain.compute_copies)
    assert half.activations * 2 == plain.activations


@pytest.mark.parametrize("world_size", [2, 8, 32])
def test_fsdp_divides_the_model_state_by_the_world_size_and_ddp_replicates_it(
    tinyllama, world_size
):
    single = estimate_memory(tinyllama, **ONE_GPU)
    sharded = estimate_memory(tinyllama, **{**ONE_GPU, "world_size": world_size, "fsdp": True,
                                            "fsdp_param_dtype": "bfloat16"})  # fmt: skip
    assert sharded.model_state == -(-single.model_state // world_size)
    assert sharded.activations == single.activations  # each rank runs its own micro-batch
    # gathered in bfloat16: no cast copies, only the root unit (embedding, head: 131M parameters)
    # and two decoder layers whole, in bfloat16
    assert sharded.compute_copies == 2 * (tinyllama.outside_layers + 2 * tinyllama.largest_layer)
    assert sharded.compute_copies < single.compute_copies / 3
    replicated = estimate_memory(tinyllama, **{**ONE_GPU, "world_size": world_size})
    assert replicated.model_state == single.model_state
    assert replicated.ddp_buckets == 4 * TINYLLAMA_PARAMETERS


def test_activation_checkpointing_keeps_only_each_layers_input(tinyllama):
    plain = estimate_memory(tinyllama, **{**ONE_GPU, "loss_kernel": "plain"})
    checkpointed = estimate_memory(
        tinyllama, **{**ONE_GPU, "loss_kernel": "plain", "activation_checkpointing": True}
    )
    assert dataclasses.replace(checkpointed, activations=plain.activations) == plain
    logits = 12 * 32000 * 8 * 2048  # unchanged: the loss is outside the layers
    # 22 layers' activations (34 bytes per unit of hidden size per token in bfloat16) against
    # each layer's float32 input and one layer recomputed at a time: 6.1x less
    assert (plain.activations - logits) / (checkpointed.activations - logits) == pytest.approx(
        22 * 34 / (22 * 4 + 34)
    )
    assert checkpointed.total < plain.total


def test_float32_compute_doubles_the_activations_and_adds_no_copies(tinyllama):
    bf16 = estimate_memory(tinyllama, **{**ONE_GPU, "loss_kernel": "plain"})
    fp32 = estimate_memory(tinyllama, **{**ONE_GPU, "loss_kernel": "plain",
                                         "compute_dtype": "float32"})  # fmt: skip
    logits = 12 * 32000 * 8 * 2048
    assert fp32.activations - logits == 2 * (bf16.activations - logits)
    assert fp32.compute_copies == 0


def test_the_chunked_loss_holds_one_chunks_logits(tinyllama):
    plain = estimate_memory(tinyllama, **{**ONE_GPU, "loss_kernel": "plain"})
    chunked = estimate_memory(tinyllama, **ONE_GPU)
    # 16,384 positions' logits against one chunk of 2,097 rows (2^26 logits at 32,000)
    assert plain.activations - chunked.activations == 12 * 32000 * (8 * 2048 - 2097)


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-demo"])  # llama-demo ties its head
def test_a_built_students_shape_is_its_configs(preset):
    model = build_student(preset, load_tokenizer("tinyllama"), seed=0, seq_len=32)
    shape = StudentShape.of(model)
    assert shape == StudentShape.from_config(model.config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # a tied head once
    assert shape.largest_layer * shape.layers + shape.outside_layers == shape.parameters
