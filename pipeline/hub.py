"""Whether a model or tokenizer spec names a Hugging Face hub repository."""

from __future__ import annotations

from huggingface_hub.utils import HFValidationError, validate_repo_id


def is_hub_id(spec: str) -> bool:
    """`owner/name`, spelled as the hub allows (huggingface_hub's own check).

    Legacy single-name ids (`gpt2`) are not taken: a typo of a preset or a local name would
    otherwise wait through the hub client's retries before failing.
    """
    if spec.count("/") != 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True
