"""--activation-checkpointing: each decoder layer of the student keeps only its inputs and runs its
forward again in the backward pass. It must train exactly what the plain student trains: the
recomputation runs the same kernels on the same inputs (and restores the RNG state), so on a CPU,
whose kernels are deterministic at a fixed thread count, losses and weights are the same bits,
and that is the tolerance these tests hold (0). On a GPU, kernels with atomics (attention's
backward) already differ between two plain runs in the last bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.models.layers import compile_layers
from pipeline.models.student import build_student
from pipeline.tokenizer import load_tokenizer
from stage2_train.parallel import checkpoint_layers

SEQ_LEN = 32


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tinyllama")


def student(tokenizer, checkpointed: bool) -> nn.Module:
    model = build_student("llama-tiny", tokenizer, seed=0, seq_len=SEQ_LEN)
    if checkpointed:
        checkpoint_layers(model)
    return model


def train_steps(model: nn.Module, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """`steps` AdamW steps of the causal-LM loss on fixed random ids: (losses, weights)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(3, model.config.vocab_size, (2, SEQ_LEN), generator=generator)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def assert_same_training(a, b) -> None:
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_checkpointed_layers_train_the_same_bits(tokenizer):
    assert_same_training(
        train_steps(student(tokenizer, True)), train_steps(student(tokenizer, False))
    )


def test_in_eval_mode_too(tokenizer):
    """A pretrained student comes from transformers in eval mode, where transformers' own switch
    (gradient_checkpointing_enable) checkpoints nothing: this one keeps only the inputs anyway."""

    def saved_bytes(model: nn.Module) -> int:
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        ids = torch.randint(3, model.config.vocab_size, (2, SEQ_LEN))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state.sum()
        return sum(sizes)

    plain, checkpointed = student(tokenizer, False).eval(), student(tokenizer, True).eval()
    # measured: 1,120,512 bytes (weights and every layer's activations) against 83,200 (each
    # layer's inputs: its hidden states, RoPE's cos and sin)
    assert saved_bytes(checkpointed) * 10 < saved_bytes(plain)
    with torch.no_grad():  # no backward, nothing recomputed: the plain forward
        ids = torch.randint(3, plain.config.vocab_size, (2, SEQ_LEN))
        assert torch.equal(plain(input_ids=ids).logits, checkpointed(input_ids=ids).logits)


def test_compiled_checkpointed_layers_are_compiled_and_train_the_same_bits(tokenizer, monkeypatch):
    """--compile layers with checkpointing compiles each layer with its checkpoint inside (one
    graph for all layers), rather than running the layers eagerly: a checkpoint put around the
    layer's forward as a partial of torch's checkpoint compiled no frame at all. Dynamo's eager
    backend keeps it to seconds (the graphs are dynamo's, whichever backend compiles them)."""
    from torch._dynamo.utils import counters

    compile_module = nn.Module.compile
    monkeypatch.setattr(
        nn.Module, "compile", lambda self, **options: compile_module(self, backend="eager")
    )
    torch._dynamo.reset()
    counters.clear()
    model = student(tokenizer, True)
    compile_layers(model, "layers", "the student")
    compiled = train_steps(model)
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 1, dict(counters["frames"])
    assert_same_training(compiled, train_steps(student(tokenizer, False)))


def test_a_student_without_decoder_layers_is_refused():
    with pytest.raises(ConfigError, match="--activation-checkpointing: the student has no decoder"):
        checkpoint_layers(nn.Linear(2, 2))
