"""Save a tokenizer as a Hugging Face folder (tokenizer.json + tokenizer_config.json) that every
HF consumer (transformers, vLLM, lm-evaluation-harness) tokenizes exactly as the pipeline does."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.tokenizer import FramingPolicy, TextTokenizer


def hf_tokenizer_config(policy: FramingPolicy) -> dict:
    """tokenizer_config.json to save beside a tokenizer.json, framing documents per `policy`.

    The generic fast class is pinned: with a model-specific class (GPT2Tokenizer, or LlamaTokenizer
    picked from config.json) transformers 5 rebuilds the pre-tokenizer and loses steps such as
    Digits, so the saved model would tokenize differently from the cache.
    """
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": policy.add_bos,
        "add_eos_token": False,
        "bos_token": policy.bos_token,
        "eos_token": policy.eos_token,
    }
    return {key: value for key, value in config.items() if value is not None}


def save_tokenizer(tokenizer: TextTokenizer, folder: Path) -> None:
    """tokenizer.json plus its config, framing documents as in training for any HF consumer.

    transformers 5 ignores `add_bos_token` for the generic fast class, so a BOS the family
    expects goes into the tokenizer's own post-processor (applied only with special tokens on,
    so offsets and `add_special_tokens=False` encodings are unchanged).
    """
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_str(tokenizer.backend.to_str())
    if tokenizer.policy.add_bos and tokenizer.policy.bos_token:
        bos = tokenizer.policy.bos_token
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokenizer.bos_id)],
        )
        existing = backend.post_processor
        backend.post_processor = (
            processors.Sequence([existing, template]) if existing is not None else template
        )
    backend.save(str(folder / "tokenizer.json"))
    config = hf_tokenizer_config(tokenizer.policy)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
