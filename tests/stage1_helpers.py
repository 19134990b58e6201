"""Tiny, randomly initialized teachers with the shipped real tokenizers, as complete HF folders,
a direct transformers forward pass to check stage-1 losses against, and the scorer's columns of a
few hard texts with the comparisons its switches are held to."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from pipeline.corpus import Corpus, CorpusOptions
from pipeline.io import read_bytes
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import resolve_teacher
from pipeline.shipped import shipped_corpus, shipped_tokenizer_file
from pipeline.space_mask import space_mask
from pipeline.tokenizer import load_tokenizer, shipped_tokenizers

SHIPPED_CORPUS = shipped_corpus("eval")


def shipped_documents(count: int) -> list[tuple[str, str]]:
    """(id, text) of the first `count` documents of the shipped held-out split."""
    docs = itertools.islice(Corpus(SHIPPED_CORPUS, CorpusOptions(id_column="id")), count)
    return [(d.doc_id, d.text) for d in docs]


def write_jsonl_corpus(path: Path, documents: list[tuple[str, str]]) -> Path:
    """A plain JSON-lines corpus with `id` and `text` fields."""
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in documents))
    return path


def make_tiny_teacher(
    folder: Path, tokenizer_name: str, *, arch: str = "llama", seed: int = 0, hidden_size: int = 32
) -> Path:
    """Save a 2-layer model whose vocabulary is the shipped tokenizer's, plus that tokenizer.

    Two heads of hidden_size / 2; vLLM's CPU attention needs a head size of at least 32."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    record = shipped_tokenizers()[tokenizer_name]
    vocab = load_tokenizer(tokenizer_name).vocab_size
    shape = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    elif arch == "gemma2":  # its logits are soft-capped: not a plain linear head
        model = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=16, final_logit_softcapping=3.0))
    else:
        raise ValueError(arch)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(read_bytes(shipped_tokenizer_file(record["file"])))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": record["add_bos"],
        "eos_token": record["eos"],
    }
    if record["add_bos"]:
        config["bos_token"] = record["bos"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def direct_losses(model, ids: np.ndarray) -> np.ndarray:
    """-log P(x_j | x_<j) from one unpadded forward pass over `ids`; NaN at position 0."""
    with torch.inference_mode():
        logits = model(torch.as_tensor(ids, dtype=torch.long)[None]).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:], dtype=torch.long)]
    return np.concatenate(([np.nan], (-picked).numpy())).astype(np.float32)


def windowed_direct_losses(model, ids: np.ndarray, max_length: int, stride: int) -> np.ndarray:
    """The sliding-window reference, written as the plain loop the windows module describes."""
    n = len(ids)
    loss = np.full(n, np.nan, dtype=np.float32)
    scored_until, start = 1, 0
    while scored_until < n:
        start = min(start, max(n - max_length, 0))
        end = min(start + max_length, n)
        window = direct_losses(model, ids[start:end])
        loss[scored_until:end] = window[scored_until - start :]
        scored_until, start = end, start + stride
    return loss


def load_model(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def windowed_direct_logprobs(model, ids: np.ndarray, max_length: int, stride: int) -> np.ndarray:
    """Row t: log_softmax of a plain forward pass's logits that predict token t, in the windows
    the windows module describes (the position convention of `loss`); NaN in row 0."""
    n = len(ids)
    out = np.full((n, model.config.vocab_size), np.nan, dtype=np.float32)
    scored_until, start = 1, 0
    while scored_until < n:
        start = min(start, max(n - max_length, 0))
        end = min(start + max_length, n)
        with torch.inference_mode():
            window = torch.as_tensor(ids[start:end], dtype=torch.long)[None]
            logprobs = torch.log_softmax(model(window).logits[0].float(), dim=-1).numpy()
        out[scored_until:end] = logprobs[scored_until - start - 1 : end - start - 1]
        scored_until, start = end, start + stride
    return out


# A byte-level and a SentencePiece teacher score these in windows of 16 (stride 6): long
# documents, a one-token one, odd whitespace and non-ASCII.
HEAD_TEXTS = [
    "Question: Tom has 3 apples\nand buys 12 more.\tHow many? Answer: 15 " * 3,
    "x",
    "Ünïcödé, emoji 🙂 and  two  spaces.",
    "Let $f(x) = x^2 + 3x$. Then $f'(x) = 2x + 3$, so the minimum is at $x = -3/2$. " * 4,
]
MAX_LENGTH, STRIDE = 16, 6


def columns_of(
    folder, texts: list[str] = HEAD_TEXTS, topk: int = 8, **switches
) -> tuple[HFScorer, dict[str, np.ndarray]]:
    """Every column (loss, top-`topk`, space) of `texts`, documents concatenated."""
    tokenizer = load_tokenizer(str(folder))
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    extras = HeadExtras(topk=topk, space_mask=space_mask(tokenizer, tokenizer.vocab_size)[0])
    scorer = HFScorer(
        resolve_teacher(str(folder)), max_length=MAX_LENGTH, stride=STRIDE, batch_tokens=64,
        asked=Asked("float32", HeadSwitches(**switches)), device="cpu", extras=extras,
    ).load()  # fmt: skip
    columns = scorer.score_columns(ids)
    return scorer, joined_columns(columns)


def joined_columns(columns: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    """Each column's documents concatenated."""
    return {name: np.concatenate(parts) for name, parts in columns.items()}


def as_stored(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def assert_within_one_float16_step(ours: np.ndarray, theirs: np.ndarray, name: str) -> None:
    """Equal as the cache stores them (float16), up to a rounding that lands on the neighbouring
    float16 value; NaN (unscored) in the same places."""
    ours, theirs = as_stored(ours), as_stored(theirs)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    scored = ~np.isnan(theirs)
    ours, theirs = ours[scored], theirs[scored]
    step = np.spacing(np.maximum(np.abs(ours), np.abs(theirs)).astype(np.float16))
    apart = np.abs(ours - theirs) > step.astype(np.float32)
    assert not apart.any(), f"{name}: {apart.sum()} values more than one float16 step apart"


def assert_same_topk_ids_but_ties(ours: dict, theirs: dict) -> None:
    """The same top-k ids in the same ranks, but where two probabilities tie as stored (torch.topk
    and the fused heads' top k by blocks each pick among tied logits in their own order)."""
    swapped = ours["topk_ids"] != theirs["topk_ids"]
    assert swapped.sum() <= 0.01 * swapped.size, swapped.sum()
    stored = as_stored(theirs["topk_probs"])
    for row, rank in zip(*np.nonzero(swapped), strict=True):
        tied = stored[row] == stored[row, rank]
        assert tied.sum() >= 2 and ours["topk_ids"][row, rank] in theirs["topk_ids"][row, tied]


def head_pass_inputs(
    rows: int = 8, vocabulary: int = 4096
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 logits [rows, vocabulary], their targets, a space mask of about 40% of the ids),
    seeded."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocabulary, generator=generator) * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocabulary, (rows,), generator=generator)
    return logits, targets, torch.rand(vocabulary, generator=generator) < 0.4


def fused_reduction_splits() -> dict[str, int]:
    """{how the fused pass is compiled: the largest split Inductor gives any of its reductions},
    each compiled first for a padded warm-up's 63 rows of a 16,384-long vocabulary, on a CPU as
    for an H200 (a GPU's rule for splitting a long reduction over few rows, an H200's 132 SMs).
    Seen where Inductor lowers the reductions (a CPU may not generate the split code a GPU would,
    so a compile may fail after). Call it in a process of its own, so that no graph cached on
    disk skips the lowering."""
    from torch._inductor import graph, ir
    from torch._inductor.codegen.common import BackendFeature
    from torch._inductor.runtime import hints

    from pipeline.scoring.head_kernels import compile_head_pass, fused_columns

    h200 = hints.DeviceProperties(
        type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
        regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
        max_threads_per_block=1024, warp_size=32,
    )  # fmt: skip
    hints.DeviceProperties.create = classmethod(lambda cls, device: h200)
    has_feature = graph.GraphLowering.has_feature
    graph.GraphLowering.has_feature = lambda self, device, feature: (
        feature != BackendFeature.REDUCE_TO_SINGLE_ELEMENT and has_feature(self, device, feature)
    )  # a GPU's backend, which splits a long reduction over few rows
    splits = []
    num_splits = ir.Reduction.num_splits

    def record_splits(*args, **kwargs):
        hint, split = num_splits(*args, **kwargs)
        splits.append(split)
        return hint, split

    ir.Reduction.num_splits = staticmethod(record_splits)
    splitting = torch.compile(fused_columns, dynamic=True)  # splits allowed: the planted contrast

    def splits_allowed(logits, *args):
        torch._dynamo.mark_static(logits, 1)
        return splitting(logits, *args)

    logits, targets, space = head_pass_inputs(63, 16_384)
    taken = {}
    for name, head_pass in (("compile_head_pass", compile_head_pass(fused_columns)),
                            ("splits allowed", splits_allowed)):  # fmt: skip
        torch._dynamo.reset()
        splits.clear()
        try:  # a copy of the logits: compile_head_pass marks the one it is given
            head_pass(logits.clone(), targets, 8, space)
        except Exception:  # the CPU's code generation of a GPU's split
            assert splits, name
        taken[name] = max(splits)
    return taken
