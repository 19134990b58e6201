"""The selective loss against hand-computed references (paper eq. 3-4 and section 6.2)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.cross_entropy import token_loss
from pipeline.guidance import (
    GuidanceSettings,
    GuidedLoss,
    guided_loss,
    kept_in_step,
    loss_denominator,
    planned_kept,
    select_tokens,
    selection_size,
)

NAN = float("nan")
# One row: tokens 0 and 5 unmapped; excess of the mapped ones (1..4) is 0.5, 2.0, 0.0, 2.0.
STUDENT = torch.tensor([[2.0, 1.0, 3.0, 0.5, 2.5, 1.5]])
TEACHER = torch.tensor([[NAN, 0.5, 1.0, 0.5, 0.5, NAN]])
ALL = torch.ones_like(STUDENT, dtype=torch.bool)


def kept_positions(keep: torch.Tensor) -> list[int]:
    return keep.flatten().nonzero().flatten().tolist()


def kept_mean(result: GuidedLoss) -> torch.Tensor:
    """The micro-batch's mean loss over its kept tokens (0 with a gradient path when nothing is
    kept): the logged `loss`, and one micro-batch's objective under --loss-normalization kept."""
    return result.kept_loss_sum / result.kept.clamp(min=1)


def eq3(result: GuidedLoss) -> torch.Tensor:
    """Paper eq. 3 for one micro-batch: the kept tokens' loss over all N valid target tokens."""
    return result.kept_loss_sum / result.valid.clamp(min=1)


def settings(**kw) -> GuidanceSettings:
    return GuidanceSettings(**kw)


def test_include_keeps_top_k_of_mapped_plus_every_unmapped_token():
    # 4 mapped -> k = ceil(0.4 * 4) = 2: tokens 2 and 4 (excess 2.0); unmapped 0 and 5 kept too.
    result = guided_loss(STUDENT, TEACHER, ALL, settings(unmapped="include"))
    assert kept_positions(select_tokens(STUDENT, TEACHER, ALL, settings())) == [0, 2, 4, 5]
    assert kept_mean(result).item() == pytest.approx((2.0 + 3.0 + 2.5 + 1.5) / 4)
    assert (result.kept, result.mapped, result.valid) == (4, 4, 6)
    assert result.loss_sum / result.valid == pytest.approx(STUDENT.mean().item())


def test_exclude_drops_unmapped_tokens():
    result = guided_loss(STUDENT, TEACHER, ALL, settings(unmapped="exclude"))
    assert kept_positions(select_tokens(STUDENT, TEACHER, ALL, settings(unmapped="exclude"))) == [
        2,
        4,
    ]
    assert kept_mean(result).item() == pytest.approx((3.0 + 2.5) / 2)


def test_mean_gives_unmapped_tokens_the_mean_teacher_loss_and_lets_them_compete():
    # mean teacher loss of mapped tokens = 0.625; excess = 1.375, .5, 2, 0, 2, .875;
    # k = ceil(0.4 * 6) = 3
    keep = select_tokens(STUDENT, TEACHER, ALL, settings(unmapped="mean"))
    assert kept_positions(keep) == [0, 2, 4]
    result = guided_loss(STUDENT, TEACHER, ALL, settings(unmapped="mean"))
    assert kept_mean(result).item() == pytest.approx((2.0 + 3.0 + 2.5) / 3)


def test_ties_at_the_threshold_go_to_earlier_positions_and_keep_exactly_k():
    student = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])
    teacher = torch.zeros_like(student)  # all mapped; excess 3, 2, 2, 2, 0; k = ceil(0.4*5) = 2
    keep = select_tokens(student, teacher, torch.ones_like(student, dtype=torch.bool), settings())
    assert kept_positions(keep) == [0, 1]
    # Ties across rows follow row-major order.
    student = torch.tensor([[1.0, 5.0], [5.0, 5.0]])
    keep = select_tokens(
        student, torch.zeros_like(student), torch.ones(2, 2, dtype=torch.bool), settings()
    )
    assert keep.tolist() == [[False, True], [True, False]]


def test_all_unmapped_row_and_all_unmapped_batch():
    student = torch.tensor([[1.0, 4.0, 2.0], [3.0, 1.0, 2.0]])
    teacher = torch.tensor([[0.0, 0.0, 0.0], [NAN, NAN, NAN]])
    valid = torch.ones_like(student, dtype=torch.bool)
    # Row 0: 3 mapped -> k = 2 (excess 4, 2); row 1 entirely unmapped.
    include = select_tokens(student, teacher, valid, settings())
    assert include.tolist() == [[False, True, True], [True, True, True]]
    exclude = select_tokens(student, teacher, valid, settings(unmapped="exclude"))
    assert exclude.tolist() == [[False, True, True], [False, False, False]]
    # mean: the mapped mean is 0, all 6 compete by student loss, k = ceil(2.4) = 3: 4, 3 and the
    # earlier of the two 2s
    mean = select_tokens(student, teacher, valid, settings(unmapped="mean"))
    assert mean.tolist() == [[False, True, True], [True, False, False]]

    nothing_mapped = torch.full_like(student, NAN)
    for how, kept in (("include", 6), ("exclude", 0), ("mean", 3)):
        result = guided_loss(student, nothing_mapped, valid, settings(unmapped=how))
        assert result.kept == kept and result.mapped == 0
    empty = guided_loss(
        student.requires_grad_(), nothing_mapped, valid, settings(unmapped="exclude")
    )
    assert kept_mean(empty).item() == 0.0
    kept_mean(empty).backward()  # still a graph: a rank with nothing kept joins DDP's all-reduce
    assert torch.equal(student.grad, torch.zeros_like(student))


def test_padding_is_never_kept_nor_counted():
    valid = torch.tensor([[True, True, True, True, False, False]])
    # Valid mapped tokens 1..3 (excess .5, 2, 0) -> k = ceil(1.2) = 2 -> 1, 2; unmapped 0 included.
    keep = select_tokens(STUDENT, TEACHER, valid, settings())
    assert kept_positions(keep) == [0, 1, 2]
    result = guided_loss(STUDENT, TEACHER, valid, settings(mode="none"))
    assert result.valid == 4 and result.kept == 4
    assert kept_mean(result).item() == pytest.approx(STUDENT[0, :4].mean().item())


def test_nan_teacher_losses_count_as_unmapped_not_as_candidates():
    teacher = torch.tensor([[NAN, NAN, 1.0, NAN, NAN, NAN]])
    result = guided_loss(STUDENT, teacher, ALL, settings(unmapped="exclude"))
    assert (result.mapped, result.kept) == (1, 1)
    assert kept_mean(result).item() == pytest.approx(3.0)


def test_random_keeps_as_many_as_token_with_seeded_noise():
    torch.manual_seed(0)
    student = torch.rand(4, 50) * 5
    teacher = torch.where(torch.rand(4, 50) < 0.2, NAN, torch.rand(4, 50) * 3)
    valid = torch.rand(4, 50) < 0.9
    for how in ("include", "exclude", "mean"):
        token = select_tokens(student, teacher, valid, settings(unmapped=how))
        first = select_tokens(
            student,
            teacher,
            valid,
            settings(mode="random", unmapped=how),
            generator=torch.Generator().manual_seed(7),
        )
        again = select_tokens(
            student,
            teacher,
            valid,
            settings(mode="random", unmapped=how),
            generator=torch.Generator().manual_seed(7),
        )
        other = select_tokens(
            student,
            teacher,
            valid,
            settings(mode="random", unmapped=how),
            generator=torch.Generator().manual_seed(8),
        )
        assert int(first.sum()) == int(token.sum())
        assert torch.equal(first, again) and not torch.equal(first, other)
        assert not (first & ~valid).any()
        if how == "include":
            assert (first[valid & torch.isnan(teacher)]).all()


@pytest.mark.parametrize("how", ["include", "exclude", "mean"])
def test_chunks_of_one_token_select_exactly_like_token_and_random(how):
    torch.manual_seed(1)
    student, teacher = torch.rand(2, 30), torch.rand(2, 30)
    teacher[torch.rand(2, 30) < 0.2] = NAN
    valid = torch.rand(2, 30) < 0.9
    every = torch.ones(2, 30, dtype=torch.bool)
    for chunked, plain in (("chunk", "token"), ("random-chunk", "random")):
        assert torch.equal(
            select_tokens(
                student, teacher, valid, settings(mode=chunked, unmapped=how),
                torch.Generator().manual_seed(5), chunk_start=every,
            ),
            select_tokens(
                student, teacher, valid, settings(mode=plain, unmapped=how),
                torch.Generator().manual_seed(5),
            ),
        )  # fmt: skip


def test_selection_size_is_ceil_without_float_error():
    assert [selection_size(n, 0.4) for n in (0, 1, 2, 5, 10, 11)] == [0, 1, 1, 2, 4, 5]
    assert selection_size(10, 0.7) == 7 and selection_size(3, 0.1) == 1
    assert selection_size(7, 1.0) == 7


@pytest.mark.parametrize("mode", ["token", "random", "none"])
@pytest.mark.parametrize("how", ["include", "exclude", "mean"])
def test_planned_kept_matches_the_selection(mode, how):
    generator = torch.Generator().manual_seed(3)
    config = settings(mode=mode, unmapped=how, topk=0.3)
    for _ in range(5):
        shape = (3, int(torch.randint(1, 40, (1,), generator=generator)))
        student = torch.rand(shape, generator=generator)
        teacher = torch.rand(shape, generator=generator)
        teacher[torch.rand(shape, generator=generator) < 0.3] = NAN
        valid = torch.rand(shape, generator=generator) < 0.8
        result = guided_loss(student, teacher, valid, config, generator=generator)
        assert result.kept == planned_kept(result.mapped, result.valid, config)


def test_kept_in_step_sums_per_selection_scope():
    # 2 ranks x 2 micro-steps of (mapped, valid)
    counts = torch.tensor([[[3, 4], [5, 5]], [[3, 4], [0, 5]]])
    micro = settings(scope="microbatch")
    # ceil(1.2)+1, ceil(2), ceil(1.2)+1, 0+5  -> 3 + 2 + 3 + 5
    assert kept_in_step(counts, micro) == 13
    # global: per micro-step (6, 8) and (5, 10) -> ceil(2.4)+2 + ceil(2)+5
    assert kept_in_step(counts, settings(scope="global")) == 12
    assert kept_in_step(counts, settings(mode="none")) == 18


def test_invalid_settings_are_refused():
    for bad in (
        {"mode": "soft"},
        {"topk": 0.0},
        {"topk": 1.5},
        {"unmapped": "skip"},
        {"scope": "node"},
    ):
        with pytest.raises(ValueError):
            GuidanceSettings(**bad)


def test_none_equals_transformers_mean_cross_entropy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    window = torch.randint(0, 97, (3, 17))
    inputs, labels = window[:, :-1], window[:, 1:].clone()
    labels[2, -4:] = -100  # padding must be ignored the same way
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
        reference = model(input_ids=inputs, labels=labels, shift_labels=labels).loss
        unshifted = model(input_ids=window, labels=window).loss  # transformers' own shift
    student = token_loss(logits, labels)
    ours = guided_loss(student, torch.zeros_like(student), labels != -100, settings(mode="none"))
    torch.testing.assert_close(kept_mean(ours), reference, rtol=1e-6, atol=1e-6)
    full = guided_loss(
        token_loss(model(input_ids=window).logits[:, :-1], window[:, 1:]).detach(),
        torch.zeros(3, 16),
        torch.ones(3, 16, dtype=torch.bool),
        settings(mode="none"),
    )
    torch.testing.assert_close(kept_mean(full), unshifted, rtol=1e-6, atol=1e-6)


CHUNK_EVERY_3 = (torch.arange(50) % 3 == 0).view(2, 25)  # 50 % 3 != 0: rank 1 starts mid-chunk


def _global_worker(rank: int, world: int, init_file: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(11)
        student = torch.rand(2, 2, 25, generator=generator)
        teacher = torch.rand(2, 2, 25, generator=generator)
        teacher[torch.rand(2, 2, 25, generator=generator) < 0.25] = NAN
        out = {}
        for mode in ("token", "random", "chunk", "random-chunk"):
            for how in ("include", "exclude", "mean"):
                config = settings(mode=mode, unmapped=how, scope="global")
                noise = torch.Generator().manual_seed(100 + rank)
                keep = select_tokens(
                    student[rank], teacher[rank], torch.ones(2, 25, dtype=torch.bool), config,
                    noise, chunk_start=CHUNK_EVERY_3,
                )  # fmt: skip
                # Plain lists: a tensor would be shared through memory that dies with this process.
                out[mode, how] = keep.tolist()
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_global_scope_is_one_selection_over_all_ranks():
    """Two gloo ranks: their global keep masks equal a single selection over both micro-batches."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            context.Process(target=_global_worker, args=(r, 2, init_file, queue)) for r in (0, 1)
        ]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0
    generator = torch.Generator().manual_seed(11)
    student = torch.rand(2, 2, 25, generator=generator)
    teacher = torch.rand(2, 2, 25, generator=generator)
    teacher[torch.rand(2, 2, 25, generator=generator) < 0.25] = NAN
    valid = torch.ones(4, 25, dtype=torch.bool)
    for mode, how in results[0]:
        joined = torch.tensor(results[0][mode, how] + results[1][mode, how])
        if mode in ("token", "chunk"):
            # one selection over both ranks' rows; each rank's first token starts a chunk piece
            starts = torch.cat((CHUNK_EVERY_3, CHUNK_EVERY_3))
            starts[2, 0] = True
            expected = select_tokens(
                student.reshape(4, 25), teacher.reshape(4, 25), valid,
                settings(mode=mode, unmapped=how), chunk_start=starts,
            )  # fmt: skip
            assert torch.equal(joined, expected), (mode, how)
        if mode in ("token", "random"):
            mapped = ~torch.isnan(teacher.reshape(4, 25))
            counts = torch.stack([mapped.sum(), valid.sum()]).reshape(1, 1, 2)
            assert int(joined.sum()) == kept_in_step(counts, settings(mode=mode, unmapped=how))


def test_eq3_divides_the_kept_loss_by_all_target_tokens():
    """Paper eq. 3: L = -E_{i~[1,N]}[W_i log P_i] = (sum of L_S over kept tokens) / N."""
    # include keeps tokens 0, 2, 4, 5 (see above): 2.0 + 3.0 + 2.5 + 1.5 = 9.0 over N = 6 tokens
    result = guided_loss(STUDENT, TEACHER, ALL, settings())
    assert eq3(result).item() == pytest.approx(9.0 / 6)
    assert kept_mean(result).item() == pytest.approx(9.0 / 4)  # the kept-count mean (`kept`)
    # A step of 2 ranks x 2 micro-steps of (mapped, valid): N = 4 + 5 + 4 + 5 = 18 target tokens.
    counts = torch.tensor([[[3, 4], [5, 5]], [[3, 4], [0, 5]]])
    assert loss_denominator(counts, settings()) == 18
    assert loss_denominator(counts, settings(normalization="kept")) == 13  # kept_in_step
    assert GuidanceSettings().normalization == "all"  # the paper's is the default


# Ten tokens in four chunks starting at 0, 3, 5, 8; the last chunk's teacher chunk is unscored.
CHUNK_STUDENT = torch.tensor([[1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 0.0, 3.0, 1.0, 1.0]])
CHUNK_TEACHER = torch.tensor([[0.5, 0.5, 0.5, 4.0, 4.0, 0.5, 0.5, 0.5, NAN, NAN]])
CHUNK_START = torch.tensor([[1, 0, 0, 1, 0, 1, 0, 0, 1, 0]], dtype=torch.bool)
TEN = torch.ones(1, 10, dtype=torch.bool)


def test_chunk_selects_whole_chunks_by_chunk_excess():
    """Table 2's chunk baseline: chunk excess = mean L_S over the chunk - its teacher loss;
    k = ceil(0.4 * 3 mapped chunks) = 2 chunks; every token of a kept chunk is kept."""
    # means 2, 5, 1 -> excess 1.5, 1.0, 0.5: chunks A (0-2) and B (3-4); D (8-9) is unmapped.
    config = settings(mode="chunk")
    keep = select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, TEN, config, chunk_start=CHUNK_START)
    assert kept_positions(keep) == [0, 1, 2, 3, 4, 8, 9]
    result = guided_loss(CHUNK_STUDENT, CHUNK_TEACHER, TEN, config, chunk_start=CHUNK_START)
    assert eq3(result).item() == pytest.approx((1 + 2 + 3 + 5 + 5 + 1 + 1) / 10)
    exclude = settings(mode="chunk", unmapped="exclude")
    keep = select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, TEN, exclude, chunk_start=CHUNK_START)
    assert kept_positions(keep) == [0, 1, 2, 3, 4]
    # mean: D gets the mapped chunks' mean teacher loss 5/3 -> excess -2/3; k = ceil(1.6) = 2
    mean = settings(mode="chunk", unmapped="mean")
    keep = select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, TEN, mean, chunk_start=CHUNK_START)
    assert kept_positions(keep) == [0, 1, 2, 3, 4]
    # max over the chunk: 3, 5, 3 -> excess 2.5, 1.0, 2.5: A and C tie and win (earlier first)
    peak = settings(mode="chunk", chunk_student_aggregate="max")
    keep = select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, TEN, peak, chunk_start=CHUNK_START)
    assert kept_positions(keep) == [0, 1, 2, 5, 6, 7, 8, 9]
    # sum: 6, 10, 3 -> excess 5.5, 9.0, 2.5: B and A
    total = settings(mode="chunk", chunk_student_aggregate="sum")
    keep = select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, TEN, total, chunk_start=CHUNK_START)
    assert kept_positions(keep) == [0, 1, 2, 3, 4, 8, 9]


def test_chunks_run_across_rows_and_padding_is_never_kept():
    """Rows of a micro-batch are consecutive windows of one stream: a chunk that a row boundary
    cuts stays one chunk; the micro-batch's first token starts a chunk even if not marked."""
    student = CHUNK_STUDENT.view(2, 5)
    teacher = CHUNK_TEACHER.view(2, 5)
    start = CHUNK_START.view(2, 5).clone()
    keep = select_tokens(
        student, teacher, TEN.view(2, 5), settings(mode="chunk"), chunk_start=start
    )
    assert kept_positions(keep) == [0, 1, 2, 3, 4, 8, 9]
    start[0, 0] = False
    keep = select_tokens(
        student, teacher, TEN.view(2, 5), settings(mode="chunk"), chunk_start=start
    )
    assert kept_positions(keep) == [0, 1, 2, 3, 4, 8, 9]
    # Padding in chunk B: B's mean is over its valid token only (5 -> excess 1.0), and the padded
    # position is never kept.
    valid = TEN.clone()
    valid[0, 4] = False
    keep = select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, valid, settings(mode="chunk"), None, start)
    assert kept_positions(keep) == [0, 1, 2, 3, 8, 9]


def test_random_chunk_keeps_k_whole_chunks_seeded():
    torch.manual_seed(2)
    lengths = torch.randint(1, 6, (40,))
    start = torch.zeros(int(lengths.sum()), dtype=torch.bool)
    start[torch.cumsum(lengths, 0) - lengths] = True
    student = torch.rand(1, start.numel())
    chunk_index = torch.cumsum(start.long(), 0) - 1
    teacher = torch.rand(40)[chunk_index][None]  # one teacher loss per chunk
    config = settings(mode="random-chunk", unmapped="exclude")
    masks = [
        select_tokens(
            student, teacher, torch.ones_like(start)[None], config,
            torch.Generator().manual_seed(seed), chunk_start=start[None],
        )[0]
        for seed in (7, 7, 8)
    ]  # fmt: skip
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])
    for mask in masks:
        per_chunk = torch.zeros(40).index_add_(0, chunk_index, mask.float())
        assert torch.equal(per_chunk > 0, per_chunk == lengths)  # whole chunks or nothing
        assert int((per_chunk > 0).sum()) == selection_size(40, 0.4)  # exactly k = 16 chunks


def test_chunk_settings_and_inputs_are_checked():
    with pytest.raises(ValueError, match="loss-normalization kept"):
        settings(mode="chunk", normalization="kept")
    with pytest.raises(ValueError, match="normalization"):
        settings(normalization="mean")
    with pytest.raises(ValueError, match="chunk student"):
        settings(chunk_student_aggregate="median")
    with pytest.raises(ValueError, match="chunk starts"):
        select_tokens(CHUNK_STUDENT, CHUNK_TEACHER, TEN, settings(mode="chunk"))
    with pytest.raises(ValueError):
        planned_kept(3, 4, settings(mode="random-chunk"))
