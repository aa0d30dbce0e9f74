"""The one-launch Triton argmax (custom_ops.triton_argmax) against torch's `argmax(dim=-1)`.

CPU: the kernel runs in Triton's interpreter on rows of up to 20k, cut into many chunks by a small
forced chunk size so the last-arriver merge runs. GPU (`gpu` mark): the sampler's real vocabularies
and batch sizes, and the kernel inside a CUDA graph replayed with new logits. Every case compares
with torch's argmax: the lowest index among equal maxima, the first NaN where a row has one, 0 for an
all -inf row.
"""
from __future__ import annotations

import pytest
import torch

from custom_ops import triton_argmax
from custom_ops.triton_argmax import argmax_chunk, row_argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = (128256, 151936, 262144)


def _hard_rows(n: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    """[n, vocab] batches, each row planted per its name (positions differ by row, and fall in
    different chunks whenever the row has several)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randn(n, vocab, generator=g)
    rows = {"spread": spread, "many ties": torch.randint(-3, 4, (n, vocab), generator=g).float()}
    early_late = spread.clone()  # equal maxima near the start and at the very end: the early one wins
    for r in range(n):
        first = (r * 37) % max(1, vocab // 4)
        early_late[r, [vocab - 1, (vocab * 2) // 3, first]] = 100.0
    rows["equal maxima"] = early_late
    nan = spread.clone()  # a NaN beats +inf, and the first NaN beats a later one
    nan[:, vocab // 8] = float("inf")
    nan[:, vocab - 1] = float("nan")
    nan[:, vocab // 2] = -float("nan")  # sign bit set: still a NaN
    rows["nan"] = nan
    rows["all -inf"] = torch.full((n, vocab), float("-inf"))
    last_finite = rows["all -inf"].clone()
    last_finite[:, -1] = -1e30  # the maximum is in the masked-off tail's chunk
    rows["last finite"] = last_finite
    signed_zero = -spread.abs() - 1.0  # -0.0 then 0.0: equal, so the -0.0 (lower index) wins
    signed_zero[:, : vocab // 3] = -0.0
    signed_zero[:, vocab // 3:] = torch.where(torch.rand(n, vocab - vocab // 3, generator=g) < 0.5, 0.0, -1.0)
    rows["signed zero"] = signed_zero
    return {name: x.to(dtype).to(device) for name, x in rows.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, vocab, chunk", [
    (1, 1, None),         # one element
    (3, 1000, None),      # one chunk, V not a multiple of its 1024 lanes: no merge
    (2, 777, 64),         # 13 chunks, the last one 9 elements
    (4, 20000, 1024),     # 20 chunks, the last partial
    (5, 20000, 256),      # 79 chunks
    (1, 5000, 16),        # 313 chunks: the merge loads 256 keys, then 57
])
def test_row_argmax_is_torchs_argmax_on_random_rows(n, vocab, chunk, dtype):
    for seed in range(2):
        x = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
        assert torch.equal(row_argmax(x, chunk), x.argmax(dim=-1))


def test_row_argmax_reads_float16_and_strided_rows():
    x = torch.randn(6, 3000, dtype=torch.float16, device=DEVICE)
    assert torch.equal(row_argmax(x, 128), x.argmax(dim=-1))
    wide = torch.randn(4, 5000, device=DEVICE)
    view = wide[:, 7:4007]  # rows 5000 apart, last dim contiguous
    assert torch.equal(row_argmax(view, 256), view.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, chunk", [(3000, 128), (20000, 1024)])
def test_planted_ties_nans_and_infinities_give_torchs_index(vocab, chunk, dtype):
    """Equal maxima in the first and last chunks (the lower index wins: a merge that kept the last
    chunk's index, or the last arriver's own, fails here), NaNs in two chunks (the first wins, above
    +inf), all -inf rows (0), a maximum only in the tail chunk, -0.0 tied with 0.0."""
    for name, x in _hard_rows(3, vocab, dtype, DEVICE, seed=vocab).items():
        assert torch.equal(row_argmax(x, chunk), x.argmax(dim=-1)), name


def test_the_first_of_equal_maxima_wins_whichever_chunk_arrives_last():
    """The interpreter runs a row's chunks in order, so the last chunk is the last arriver: it merges,
    and its own maximum equals the first chunk's."""
    x = torch.randn(2, 4096, device=DEVICE)
    x[0, 3] = x[0, 4095] = 9.0
    x[1, 4000] = x[1, 1030] = 9.0
    assert row_argmax(x, 1024).tolist() == [3, 1030]


def test_a_merge_over_more_keys_than_one_load_reads_every_step():
    """313 chunks: the last arriver reduces 256 keys, then 57; the maxima are in the second step."""
    x = torch.randn(1, 5000, device=DEVICE)
    x[0, 4990] = x[0, 4200] = 50.0
    assert row_argmax(x, 16).tolist() == [4200]


def test_two_calls_reuse_the_workspace_and_leave_the_counters_at_zero():
    x = torch.randn(4, 5000, device=DEVICE)
    assert torch.equal(row_argmax(x, 256), x.argmax(dim=-1))
    keys = triton_argmax._partials[x.device].buffer
    arrivals = triton_argmax._arrivals[x.device].buffer
    assert int(arrivals.count_nonzero()) == 0
    y = torch.randn(4, 5000, device=DEVICE)
    assert torch.equal(row_argmax(y, 256), y.argmax(dim=-1))  # stale counters would merge too early
    assert triton_argmax._partials[x.device].buffer is keys
    assert triton_argmax._arrivals[x.device].buffer is arrivals
    assert int(arrivals.count_nonzero()) == 0
    # more rows and chunks than the workspace holds: it grows, the results stay torch's
    z = torch.randn(9, 5000, device=DEVICE)
    assert torch.equal(row_argmax(z, 64), z.argmax(dim=-1))
    assert triton_argmax._partials[x.device].buffer.numel() >= 9 * 79
    assert int(triton_argmax._arrivals[x.device].buffer.count_nonzero()) == 0


def test_chunk_rule_spreads_small_batches_and_bounds_the_chunk():
    sms = 132
    assert argmax_chunk(1, 262144, sms) == 1024  # 256 programs: about two per SM
    assert argmax_chunk(1, 151936, sms) == 1024
    assert argmax_chunk(64, 262144, sms) == 8192  # 32 chunks a row: 2048 programs of 16 KiB (bf16)
    assert argmax_chunk(1, 10, sms) == 1024  # never shorter than one full load
    chunks = [-(-262144 // argmax_chunk(n, 262144, sms)) for n in (1, 2, 4, 7, 16, 64, 256)]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] == 256 and chunks[-1] == 32


@pytest.mark.parametrize("bad, match", [
    (torch.randn(10), r"\[N, V\]"),
    (torch.randn(2, 0), r"\[N, V\]"),
    (torch.randint(0, 5, (2, 10)), "torch.int64"),
    (torch.randn(10, 2).t(), "contiguous last dimension"),
])
def test_row_argmax_names_what_it_cannot_read(bad, match):
    with pytest.raises(ValueError, match=match):
        row_argmax(bad.to(DEVICE))


def test_row_argmax_keeps_torchs_argmax_for_cpu_tensors(monkeypatch):
    """The Triton kernel is only a CUDA candidate: on CPU nothing is timed and nothing reaches it,
    even for a (vocabulary, dtype) whose method was chosen on a GPU."""
    import custom_ops.triton_argmax
    import engine.sample.argmax as engine_argmax

    def refuse(x):
        raise AssertionError("the Triton argmax ran on a CPU tensor")

    monkeypatch.setattr(custom_ops.triton_argmax, "row_argmax", refuse)  # the candidate engine.sample.argmax takes
    argmax = engine_argmax.RowArgmax()
    x = torch.randn(3, 4096)
    assert argmax.choose(x) is False
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    argmax._methods[(4096, torch.float32)] = refuse  # as if a GPU had chosen it
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", VOCABS)
def test_gpu_row_argmax_is_torchs_argmax_at_the_samplers_shapes(vocab, dtype):
    for n in (1, 7, 64):
        for name, x in _hard_rows(n, vocab, dtype, "cuda", seed=vocab + n).items():
            assert torch.equal(row_argmax(x), x.argmax(dim=-1)), (n, name)
    assert int(triton_argmax._arrivals[x.device].buffer.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", VOCABS)
def test_gpu_row_argmax_in_a_cuda_graph_replayed_with_new_logits(vocab, dtype):
    for n in (1, 7, 64):
        batches = list(_hard_rows(n, vocab, dtype, "cuda", seed=vocab * n).values())
        x = torch.randn(n, vocab, device="cuda").to(dtype)
        torch.cuda.synchronize()
        row_argmax(x)  # compiled and the workspace sized outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = row_argmax(x)
        for new in batches:  # every replay reads new logits: random, tied, NaN, -inf, signed zeros
            x.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, new.argmax(dim=-1)), n
        del graph


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", VOCABS)
def test_gpu_row_argmax_chosen_method_gives_torchs_tokens(vocab):
    from engine.sample.argmax import RowArgmax
    argmax = RowArgmax()
    argmax.choose(torch.randn(4, vocab, device="cuda", dtype=torch.bfloat16))
    for n in (1, 7, 64):
        for dtype in (torch.bfloat16, torch.float32):
            for name, x in _hard_rows(n, vocab, dtype, "cuda", seed=n).items():
                assert torch.equal(argmax(x), x.argmax(dim=-1)), (n, dtype, name)
