"""Stage 1's `--row-packing` (pipeline/scoring/batching.py, pipeline/scoring/hf.py,
docs/stage1-gpu-path.md): packed rows hold every window exactly once without overlap; a packed
window is scored with exactly its own context, so every column equals the document scored alone,
windowed long documents included, for a byte-level and a SentencePiece teacher, under the dense
mask and flex attention; a teacher that does not honour the document mask is refused (or, under
`auto`, kept padded); what was resolved is recorded with the worker. `--batch-overlap on` (a batch
read back only once the next is launched) caches what serial batches do, and a packed batch's
work never waits for the device. `--compile layers` scores what eager layers do, and the warm-up
at load compiles every shape a unit can give what is compiled."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline import choices, document_attention
from pipeline.errors import ConfigError
from pipeline.scoring import device, head, head_kernels, hf, resolve
from pipeline.scoring.batching import pack_rows, packed_layouts, padded_layouts
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.resolve import Asked
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import resolve_teacher
from pipeline.scoring.windows import plan_document_windows
from pipeline.space_mask import space_mask
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import (
    HEAD_TEXTS,
    MAX_LENGTH,
    STRIDE,
    assert_same_topk_ids_but_ties,
    assert_within_one_float16_step,
    columns_of,
    joined_columns,
    make_tiny_teacher,
)

FLOAT_COLUMNS = ("loss", "topk_probs", "topk_rest", "space_logprob")
# The head tests' texts, whose windows fill rows of their own, and short documents that share one.
TEXTS = [*HEAD_TEXTS, "a b", "hello world", "2 + 2 = 4\n", "Answer: #### 15"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    # heads of 32: torch 2.13's compiled flex_attention on the CPU is wrong for heads of 16
    # (measured 2026-11-26: off by ~1.5 against SDPA; the load probe refuses such a teacher)
    return {
        name: make_tiny_teacher(root / name, name, hidden_size=64)
        for name in ("smollm2", "tinyllama")
    }


def test_packed_rows_hold_every_window_once_within_the_row_and_the_batch_budget():
    generator = np.random.default_rng(0)
    lengths = np.concatenate([generator.integers(2, 300, 500), [512, 512, 511]])
    row, offset = pack_rows(lengths, 512)
    end = offset + lengths
    assert (offset >= 0).all() and (end <= 512).all()
    for r in np.unique(row):  # no two windows of a row overlap
        members = np.flatnonzero(row == r)
        spans = sorted(zip(offset[members], end[members], strict=True))
        assert all(a[1] <= b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))
    np.testing.assert_array_equal(pack_rows(lengths, 512)[0], row)  # deterministic

    layouts = packed_layouts(lengths, 512, 2048)
    placed = np.concatenate([layout.windows for layout in layouts])
    assert sorted(placed.tolist()) == list(range(len(lengths)))  # each window once
    assert all(layout.rows <= 4 and layout.length == 512 for layout in layouts)
    # First fit, longest first, fills rows: here the slots are within 1% of the tokens, while a
    # window per row pads to each batch's longest.
    packed = sum(layout.slots for layout in layouts)
    padded = sum(layout.slots for layout in padded_layouts(lengths, 2048))
    assert packed <= 1.01 * lengths.sum() < padded
    with pytest.raises(ValueError, match="does not fit a row of 256"):
        pack_rows(lengths, 256)


@pytest.mark.parametrize("name", ["smollm2", "tinyllama"])  # byte-level, SentencePiece
def test_a_packed_document_gets_every_column_it_gets_scored_alone(teachers, name):
    padded_scorer, padded = columns_of(teachers[name], TEXTS, row_packing="padded")
    packed_scorer, packed = columns_of(teachers[name], TEXTS, row_packing="packed", attention="dense")
    assert packed_scorer.describe()["row_packing"] == "packed"
    assert packed_scorer.describe()["attention"] == "dense"
    assert padded_scorer.describe()["row_packing"] == "padded"
    # The texts' windows share rows: some row holds two or more.
    ids = load_tokenizer(str(teachers[name])).encode_batch(TEXTS)
    windows = plan_document_windows([len(e.ids) for e in ids], MAX_LENGTH, STRIDE)
    layouts = packed_scorer.layouts(windows)
    assert any(len(np.unique(layout.row)) < len(layout.windows) for layout in layouts)
    alone = {}
    for text in TEXTS:  # each document in a batch of its own
        _, columns = columns_of(teachers[name], row_packing="padded", texts=[text])
        for column, values in columns.items():
            alone.setdefault(column, []).append(values)
    alone = joined_columns(alone)
    for column in FLOAT_COLUMNS:
        assert_within_one_float16_step(packed[column], alone[column], column)
        np.testing.assert_allclose(packed[column], alone[column], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(packed[column], padded[column], rtol=1e-5, atol=1e-6)
    assert_same_topk_ids_but_ties(packed, alone)


@pytest.mark.slow  # the compiled test below compares flex to the dense mask too, layers compiled
def test_flex_attention_scores_packed_rows_as_the_dense_mask_does(teachers):
    """A GPU's choice for packed rows (flex_attention's block mask, compiled on the CPU here)."""
    flex_scorer, flex = columns_of(teachers["smollm2"], TEXTS, row_packing="packed", attention="flex")
    assert flex_scorer.describe()["attention"] == "flex"
    _, dense = columns_of(teachers["smollm2"], TEXTS, row_packing="packed", attention="dense")
    for column in FLOAT_COLUMNS:
        np.testing.assert_allclose(flex[column], dense[column], rtol=1e-5, atol=1e-6)
    assert_same_topk_ids_but_ties(flex, dense)


@pytest.fixture
def compiled_as_on_a_gpu(monkeypatch):
    """What a GPU compiles (the fused head, flex attention's block-mask builder) compiled here
    too, on the CPU: `compiles_on` is the only difference. Nothing is compiled to start with, as
    in a new worker, so that no earlier test's compile hides one. Calling what it yields makes
    scorers built after it eager again, as a CPU's are."""
    modules = (head, document_attention)
    for module in modules:
        monkeypatch.setattr(module, "compiles_on", lambda device: True)
    torch._dynamo.reset()
    head_kernels.compiled_pass.cache_clear()

    def eager_again():
        for module in modules:
            monkeypatch.setattr(module, "compiles_on", choices.compiles_on)

    yield eager_again


# packed is a GPU's choice (auto); padded compiles graphs of its own, more slowly. The loss alone
# compiles the layers, flex attention and block mask that every column does, and a head graph of
# its own without the extras. All are slow (79 s for packed rows with every column, the default
# suite's slowest test); the default suite proves compiled decoder layers train what eager ones
# do in stage 2 (tests/test_stage2_train.py), and the switch refusals below still compile here
@pytest.mark.parametrize(
    "packing, columns",
    [
        pytest.param("packed", "all", marks=pytest.mark.slow),  # 79 s: the suite's slowest
        pytest.param("packed", "loss", marks=pytest.mark.slow),
        pytest.param("padded", "all", marks=pytest.mark.slow),
        pytest.param("padded", "loss", marks=pytest.mark.slow),
    ],
)
def test_compiled_layers_score_what_eager_ones_do_and_compile_only_at_load(
    teachers, packing, columns, compiled_as_on_a_gpu
):
    """`--compile layers` (auto on a GPU) changes no column beyond rounding: against a scorer
    eager throughout (layers, head and, for packed rows, the dense document mask in place of flex
    attention), so that the compiled fused head is proven here too, with its top-k and space
    columns (test_stage1_head.py's compiled pass, slow, adds bf16 logits). A compiled function
    compiles again for a new shape (a batch's row count or length, a head chunk's rows, a mask
    where there was none) until it has seen every kind, and on a GPU a compile took longer than
    scoring a small unit (bench_gpu.py, H200, 2026-11-26): the warm-up at load shows the decoder
    layers, the head, flex attention and its block mask every kind of shape, so units of any
    shape compile nothing: with the loss alone, and with the top-k and space columns (the fused
    head's other graphs; `+space` cost the job 12% on an H200, run 4, where its head pass cost
    1%)."""
    from torch._dynamo.utils import counters

    settings = dict(max_length=MAX_LENGTH, stride=STRIDE, batch_tokens=64, device="cpu")
    switches = HeadSwitches(
        head_kernel="fused", row_packing=packing, attention="flex" if packing == "packed" else "auto"
    )
    teacher = resolve_teacher(str(teachers["smollm2"]))
    tokenizer = load_tokenizer(str(teachers["smollm2"]))
    if columns == "all":
        mask = space_mask(tokenizer, tokenizer.vocab_size)[0]
        settings["extras"] = HeadExtras(topk=8, space_mask=mask)
    scorer = hf.HFScorer(teacher, asked=Asked("float32", replace(switches, compile="layers")), **settings).load()
    compiled = counters["stats"]["unique_graphs"]
    assert (scorer.describe()["head_kernel"], scorer.describe()["compile"]) == ("fused", "layers")
    text = " ".join(["seven apples and six pears"] * 2)
    ids = [e.ids[:MAX_LENGTH] for e in tokenizer.encode_batch([text])] * 9
    assert len(ids[0]) > MAX_LENGTH // 2  # a row each
    two_tokens = tokenizer.encode("a b").ids[:2]  # one scored position: a head chunk of one row
    units = [ids[:1], ids[:3], ids[:4], ids[:6], ids[:9], [two_tokens], [*ids[:2], two_tokens]]
    # padded: batches of other lengths, with padding and without
    units += [[ids[0], ids[0][:10]], [ids[0][:12]] * 3, [ids[0][:5], ids[0][:7], ids[0][:12]]]
    texts = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    compiled_columns = [joined_columns(scorer.score_columns(unit)) for unit in [*units, texts]]
    assert counters["stats"]["unique_graphs"] == compiled
    packed = packing == "packed"
    assert scorer.describe()["attention"] == ("flex" if packed else None)
    switches = replace(switches, attention="dense" if packed else "auto")
    compiled_as_on_a_gpu()  # the reference: eager, as on a CPU
    eager = hf.HFScorer(teacher, asked=Asked("float32", replace(switches, compile="off")), **settings).load()
    assert scorer.columns.compute is not eager.columns.compute is head_kernels.fused_columns
    assert (eager.describe()["compile"], eager.describe()["attention"]) == (
        "off", "dense" if packed else None
    )  # fmt: skip
    every_column = {*FLOAT_COLUMNS, "topk_ids"}
    for unit, ours in zip([*units, texts], compiled_columns, strict=True):
        theirs = joined_columns(eager.score_columns(unit))
        assert ours.keys() == theirs.keys() == ({"loss"} if columns == "loss" else every_column)
        for column in ours.keys() - {"topk_ids"}:
            np.testing.assert_allclose(ours[column], theirs[column], rtol=1e-5, atol=1e-6)
        if "topk_ids" in ours:
            assert_same_topk_ids_but_ties(ours, theirs)


def test_a_teacher_without_decoder_layers_is_refused_compiling_or_runs_eagerly(
    teachers, tmp_path, monkeypatch
):
    """`--compile layers` compiles model.model.layers; a teacher of another shape (GPT-2's
    transformer.h) is refused in one line when it is asked for, and runs eagerly under auto."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    vocab = load_tokenizer(str(teachers["smollm2"])).vocab_size
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        folder
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((teachers["smollm2"] / name).read_bytes())
    settings = dict(max_length=16, stride=6, batch_tokens=64, device="cpu")
    teacher = resolve_teacher(str(folder))
    with pytest.raises(ConfigError, match=r"^--compile layers: the teacher has no decoder layers "
                       r"at model.layers; use --compile off$"):  # fmt: skip
        hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(compile="layers")), **settings).load()
    monkeypatch.setattr(resolve, "resolve_compile", lambda choice, device: "layers")  # auto on a GPU
    assert hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(compile="auto")), **settings).load().describe()["compile"] == "off"


def test_layers_that_fail_to_compile_are_refused_or_run_eagerly_under_auto(
    teachers, monkeypatch, capsys
):
    """Where the compiler fails on the teacher's layers (planted: a backend that raises, as
    Inductor does on a kernel it cannot build), `--compile layers` is refused in one line at load,
    and auto (a GPU's default) says so in one warning and scores with eager layers."""
    from pipeline.log import configure
    from pipeline.models.layers import decoder_layers

    def failing_backend(graph, example_inputs):
        raise RuntimeError("no kernel for this layer")

    def compile_failing(model, choice, who):
        for layer in decoder_layers(model) if choice == "layers" else []:
            layer.compile(backend=failing_backend)

    monkeypatch.setattr(hf, "compile_layers", compile_failing)
    torch._dynamo.reset()
    teacher = resolve_teacher(str(teachers["smollm2"]))
    settings = dict(max_length=16, stride=6, batch_tokens=64, device="cpu")
    with pytest.raises(ConfigError, match=r"^--compile layers: compiling the teacher's layers "
                       r"failed \(RuntimeError: no kernel for this layer\); use --compile off$"):  # fmt: skip
        hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(compile="layers")), **settings).load()
    monkeypatch.setattr(resolve, "resolve_compile", lambda choice, device: "layers"
                        if choice == "auto" else choice)  # auto as on a GPU  # fmt: skip
    configure()
    scorer = hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(compile="auto")), **settings).load()
    assert scorer.describe()["compile"] == "off"
    said = capsys.readouterr().err
    assert said.count("[scoring] --compile auto: compiling the teacher's layers failed") == 1, said
    ids = [e.ids for e in load_tokenizer(str(teachers["smollm2"])).encode_batch(TEXTS)]
    eager = hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(compile="off")), **settings).load()
    for ours, theirs in zip(scorer.score(ids), eager.score(ids), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def mask_ignored(model, ids, segments, positions) -> dict:
    """A forward pass that attends across the whole row: what a teacher that drops the
    document mask (and the restarted positions) computes."""
    return {"input_ids": ids}


def test_a_teacher_that_does_not_honour_the_mask_is_refused_or_kept_padded(teachers, monkeypatch):
    teacher = resolve_teacher(str(teachers["smollm2"]))
    settings = dict(max_length=16, stride=6, batch_tokens=64, device="cpu")
    monkeypatch.setattr(document_attention, "packed_inputs", mask_ignored)
    with pytest.raises(ConfigError, match=r"^--row-packing packed: this teacher's forward pass "
                       r"gives a packed window other hidden states .* use --row-packing padded$"):  # fmt: skip
        hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(row_packing="packed", attention="dense")), **settings).load()
    # auto packs on a GPU; a teacher that cannot be packed stays padded there
    monkeypatch.setattr(resolve, "on_device", lambda choice, device, gpu, cpu: gpu
                        if choice == "auto" else choice)  # fmt: skip
    scorer = hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(row_packing="auto", attention="dense")), **settings).load()
    assert (scorer.describe()["row_packing"], scorer.describe()["attention"]) == ("padded", None)
    monkeypatch.undo()
    monkeypatch.setattr(resolve, "on_device", lambda choice, device, gpu, cpu: gpu
                        if choice == "auto" else choice)  # fmt: skip
    scorer = hf.HFScorer(teacher, asked=Asked("float32", HeadSwitches(row_packing="auto", attention="dense")), **settings).load()
    assert scorer.describe()["row_packing"] == "packed"


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_overlapped_batches_cache_what_serial_batches_do(teachers, packing):
    """`--batch-overlap on` reads a batch back only after the next one is launched. On a CPU
    nothing runs asynchronously, so this proves the bookkeeping of the batch held back (each
    batch's columns placed into its own windows, progress batch by batch), not the overlap."""
    tokenizer = load_tokenizer(str(teachers["tinyllama"]))
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    extras = HeadExtras(topk=8, space_mask=space_mask(tokenizer, tokenizer.vocab_size)[0])
    by_overlap = {}
    for overlap in ("off", "on"):
        scorer = hf.HFScorer(
            resolve_teacher(str(teachers["tinyllama"])), max_length=MAX_LENGTH, stride=STRIDE,
            batch_tokens=64, device="cpu", extras=extras, asked=Asked("float32", HeadSwitches(
                row_packing=packing, attention="dense", batch_overlap=overlap
            )),
        ).load()  # fmt: skip
        assert scorer.describe()["batch_overlap"] == overlap
        progress: list[int] = []
        by_overlap[overlap] = (scorer.score_columns(ids, progress.append), progress)
    (serial, serial_progress), (overlapped, overlapped_progress) = by_overlap.values()
    assert len(serial_progress) >= 4  # batches enough for one to be held back behind another
    assert overlapped_progress == serial_progress
    assert serial.keys() == overlapped.keys() == {"loss", *extras.columns()}
    # The worker's two halves (stage1_score/worker.py: UnitScorer.score_unit): queued, every
    # batch but the last is read back; the last only once collected, after the teacher is
    # released.
    held: list[int] = []
    queued = scorer.queue_columns(ids, held.append)
    assert held == serial_progress[:-1]
    collected = queued.collect()
    assert held == serial_progress
    for columns in (overlapped, collected):
        for name in serial:
            for ours, theirs in zip(columns[name], serial[name], strict=True):
                np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_each_batch_is_timed_from_its_first_input_copy_to_its_columns_copies(
    teachers, overlap, monkeypatch
):
    """A scoring call's `device_time` (what stage1-run.json records of each unit, and the
    driver's progress lines sum) comes from events on the device's stream: a batch is in the device's hands
    from its first input copy to its columns' copies, and the device idles between batches and
    at a call's edge. Here a clock that counts the work queued (each input copy, the body, the
    head) stands in for the device's: every launch falls within a batch, none between batches
    or between two calls, and the first call after the warm-up has no edge."""
    launches = [0]

    def counting(launch):
        def counted(*args, **kwargs):
            launches[0] += 1
            return launch(*args, **kwargs)

        return counted

    tokenizer = load_tokenizer(str(teachers["tinyllama"]))
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    scorer = hf.HFScorer(
        resolve_teacher(str(teachers["tinyllama"])), max_length=MAX_LENGTH, stride=STRIDE,
        batch_tokens=64, device="cpu",
        asked=Asked("float32", HeadSwitches(row_packing="padded", batch_overlap=overlap)),
    ).load()  # fmt: skip
    monkeypatch.setattr(device, "time", SimpleNamespace(monotonic=lambda: launches[0]))
    monkeypatch.setattr(hf, "to_device", counting(hf.to_device))
    monkeypatch.setattr(scorer, "body", counting(scorer.body))
    monkeypatch.setattr(scorer.columns, "of_batch", counting(scorer.columns.of_batch))
    records = []
    for _ in range(2):  # two units
        queued = scorer.queue_columns(ids)
        queued.collect()
        records.append(queued.device_time.record())
    batches = len(scorer.layouts(scorer.plan(ids).windows))
    assert batches >= 4
    # a batch: its ids, mask, scored rows and positions copied in, the body, the head
    assert launches[0] == 2 * 6 * batches
    first, second = ({"batches": batches, "in_batches_s": 6 * batches, "between_batches_s": 0}
                     for _ in range(2))  # fmt: skip
    assert records == [first | {"before_first_s": None}, second | {"before_first_s": 0}]


class DeviceReads(TorchDispatchMode):
    """Records the ops that make the host wait for a CUDA device (everything queued before them
    included): a value read back (item(), bool(), equal), a shape that depends on values
    (nonzero, masked_select, unique, bincount, repeat_interleave), indexing by a boolean mask."""

    READS = {
        "item", "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
        "unique_consecutive", "unique_dim", "bincount", "repeat_interleave",
    }  # fmt: skip

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        indices = args[1] if name.startswith("index") and len(args) > 1 else None
        by_mask = isinstance(indices, (list, tuple)) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
        )
        if name in self.READS or by_mask:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_packed_batch_is_queued_without_waiting_for_the_device(teachers):
    """`--batch-overlap on` holds only if nothing in a batch's work reads a value back from the
    device: on a GPU one such read waits for every batch queued before it, and nothing on a CPU
    shows it. The batch's work (inputs, packed mask, body, scored positions, every column of the
    fused head) and flex attention's block mask are audited op by op; the only wait is the one
    for the columns' copies (QueuedBatch, an event). Padded rows are not audited: transformers
    reads their 2-D mask once per batch (whether it may skip it), which packed rows never give
    it."""
    with torch.inference_mode(), DeviceReads() as audit:  # it sees what it must, as scoring runs
        torch.ones(3)[torch.tensor([True, False, True])]
        int(torch.ones(1).max())
        bool(torch.ones(1))
    assert audit.reads == ["index", "item", "is_nonzero"]

    tokenizer = load_tokenizer(str(teachers["tinyllama"]))
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    extras = HeadExtras(topk=8, space_mask=space_mask(tokenizer, tokenizer.vocab_size)[0])
    scorer = hf.HFScorer(
        resolve_teacher(str(teachers["tinyllama"])), max_length=MAX_LENGTH, stride=STRIDE,
        batch_tokens=64, device="cpu", extras=extras, asked=Asked("float32", HeadSwitches(
            row_packing="packed", attention="dense", head_kernel="fused", batch_overlap="on"
        )),
    ).load()  # fmt: skip
    with DeviceReads() as audit:
        columns = scorer.score_columns(ids)
    assert audit.reads == []
    assert not np.isnan(columns["loss"][0][1:]).any()
    segments = torch.tensor([[1] * 5 + [2] * 7 + [0] * 4, [3] * 16])
    with DeviceReads() as audit:
        document_attention.document_block_mask(segments)
    assert audit.reads == []


def test_auto_is_padded_on_a_cpu(teachers):
    scorer, _ = columns_of(teachers["smollm2"])
    assert (scorer.describe()["row_packing"], scorer.describe()["attention"]) == ("padded", None)


def test_the_packing_benchmark_plans_both_ways_and_packed_rows_pad_less(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_stage1_packing

    assert bench_stage1_packing.main(["--docs", "300", "--docs-per-shard", "100"]) == 0
    out = capsys.readouterr().out
    figures = dict(re.findall(r"(padded|packed) +[\d,]+ slots: real tokens / slots ([\d.]+)", out))
    assert "shipped training split: 300 documents" in out
    assert float(figures["padded"]) < float(figures["packed"]) <= 1.0
