"""The student presets: Llama shapes for training from scratch, by name. Apart from
pipeline.models.student so that a command's --help lists them without importing torch."""

from __future__ import annotations

# Llama-architecture students for training from scratch; the vocabulary comes from the tokenizer.
PRESETS: dict[str, dict] = {
    "llama-tiny": {  # tests: a forward pass costs milliseconds
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "llama-small": {  # benchmarks on a CPU
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    # `make demo`'s warm-started student: with tied embeddings and a 32k vocabulary, 51% of its
    # 4.18M parameters are outside the embedding (2.13M body, 2.05M embedding), at a cost per
    # token a 2-core CPU can pretrain and continue in minutes.
    "llama-demo": {
        "hidden_size": 64,
        "intermediate_size": 1024,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    # The dose-response on a GPU (manifests/dose-response-gpu.toml): 42.1M parameters, 61% of them
    # outside the tied embedding, trained from scratch in about a minute on one GPU.
    "llama-40m": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "tinyllama-1.1b": {  # the paper's student architecture
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    },
}
