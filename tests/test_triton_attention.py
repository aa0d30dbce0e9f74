"""Triton attention kernels against the torch reference.

CPU: the kernels run in Triton's interpreter on tiny shapes (a few programs each). GPU (`gpu` mark):
many random shapes in bf16/fp16 against a float64 reference, and decode through CUDA graph replay.
Outputs are poisoned with NaN before every call so an unwritten row cannot pass.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from custom_ops import AttentionLayer, AttentionMetadata, reference
from custom_ops.metadata import SCRATCH_BLOCK

# The small-shape tests run in the interpreter on CPU and as compiled kernels where there is CUDA.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_layer(num_heads, num_kv_heads, head_dim, window=None, softcap=None) -> AttentionLayer:
    return AttentionLayer(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window, softcap)


def make_batch(prefix_lens, query_lens, layer, block_size, dtype, device, pad_tokens=0, max_seq_len=None):
    """Random q/k/v for the new tokens, a random cache (the prefixes' contents) with shuffled pages,
    and the metadata the engine would build; padding rows write slots of the scratch block."""
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    blocks_per_seq = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    pages = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0 is the scratch block
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), SCRATCH_BLOCK, dtype=torch.int32)
    slots = []
    for i, (prefix, seq_len) in enumerate(zip(prefix_lens, seq_lens)):
        for j in range(blocks_per_seq[i]):
            block_tables[i, j] = pages.pop()
        for pos in range(prefix, seq_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    n = len(slots)
    slots += [SCRATCH_BLOCK * block_size + (i % block_size) for i in range(pad_tokens)]
    t = n + pad_tokens
    q = torch.randn(t, hq, d, dtype=dtype, device=device)
    k = torch.randn(t, hkv, d, dtype=dtype, device=device)
    v = torch.randn(t, hkv, d, dtype=dtype, device=device)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_actual_tokens=n, max_query_len=max(query_lens), max_seq_len=max_seq_len or max(seq_lens),
        is_uniform_decode=all(ql == 1 for ql in query_lens))
    return q, k, v, cache, meta


def reference_paged(q, k, v, cache, meta, layer, dtype=torch.float64):
    """The reference on CPU copies in `dtype`; returns (out, cache after the store)."""
    cpu_meta = AttentionMetadata(
        meta.slot_mapping.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(), meta.block_tables.cpu(),
        meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len, meta.is_uniform_decode,
        meta.real_tokens_on_device)
    ref_cache = cache.detach().cpu().clone()
    out = torch.empty(q.shape, dtype=dtype)
    # store in the cache's dtype (as the kernel does), attend in `dtype`
    reference.store_kv(k[: meta.num_actual_tokens].cpu(), v[: meta.num_actual_tokens].cpu(), ref_cache,
                       cpu_meta.slot_mapping)
    reference.paged_attention(q.cpu().to(dtype), k.cpu().to(dtype), v.cpu().to(dtype), out, layer,
                              ref_cache.to(dtype), cpu_meta)
    return out, ref_cache


def run_paged(q, k, v, cache, meta, layer, **kwargs):
    from custom_ops import triton_attention
    out = torch.full_like(q, float("nan"))
    triton_attention.paged_attention(q, k, v, out, layer, cache, meta, **kwargs)
    return out


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_close(out, ref, n, dtype):
    """Real rows near the reference (relative L2 by dtype), padding rows zero, nothing NaN."""
    assert not torch.isnan(out).any(), "an output element was never written (NaN poison survived)"
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.2e-2}[out.dtype]
    err = rel_err(out[:n], ref[:n])
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    assert (out[n:] == 0).all()


# ------------------------------------------------------------------ small shapes (CPU interpreter / GPU)


def test_store_kv_writes_real_rows_by_slot_and_skips_padding():
    from custom_ops.triton_kv_store import store_kv
    layer = make_layer(4, 2, 16)
    q, k, v, cache, meta = make_batch([3, 0], [4, 2], layer, block_size=4, dtype=torch.float32, device=DEVICE,
                                      pad_tokens=2)
    expected = cache.clone()
    reference.store_kv(k[: meta.num_actual_tokens], v[: meta.num_actual_tokens], expected, meta.slot_mapping)
    store_kv(k, v, cache, meta.slot_mapping, meta.num_actual_tokens)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 5.0), (1, None), (64, 3.0)])
def test_dense_causal_matches_reference(dtype, window, softcap):
    from custom_ops.triton_attention import dense_causal_attention
    layer = make_layer(4, 2, 16, window, softcap)
    t = 37  # three 16-row query tiles, off the tile boundary
    q, k, v = (torch.randn(t, h, 16, dtype=dtype, device=DEVICE) for h in (4, 2, 2))
    out = torch.full_like(q, float("nan"))
    dense_causal_attention(q, k, v, out, layer)
    ref = reference.causal_attention(q.double(), k.double(), v.double(), layer)
    check_close(out, ref, t, dtype)


def test_dense_causal_reads_strided_qkv_views():
    """Models split one fused qkv projection: q, k, v are strided views of it."""
    from custom_ops.triton_attention import dense_causal_attention
    layer = make_layer(4, 1, 16)
    qkv = torch.randn(20, 6, 16, device=DEVICE)
    q, k, v = qkv[:, :4], qkv[:, 4:5], qkv[:, 5:6]
    out = torch.full_like(q, float("nan"))
    dense_causal_attention(q, k, v, out, layer)
    check_close(out, reference.causal_attention(q.double(), k.double(), v.double(), layer), 20, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 4.0)])
@pytest.mark.parametrize("fuse_store", [True, False], ids=["fused-store", "store-kernel"])
def test_paged_extend_matches_reference(dtype, window, softcap, fuse_store):
    """Three sequences: a fresh prefill, a decode-like single token, a chunk after a cached prefix;
    padding rows are never stored (the reference cache is compared exactly)."""
    layer = make_layer(4, 1, 16, window, softcap)  # GQA 4
    q, k, v, cache, meta = make_batch([0, 5, 19], [7, 1, 12], layer, block_size=8, dtype=dtype,
                                      device=DEVICE, pad_tokens=3)
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    out = run_paged(q, k, v, cache, meta, layer, fuse_store=fuse_store)
    assert torch.equal(cache.cpu(), ref_cache)
    check_close(out, ref, meta.num_actual_tokens, dtype)


def test_paged_prefill_zeroes_more_padding_rows_than_any_sequence_has_queries():
    """A short mixed step padded to a large capture size: the prefill launch itself writes every padding
    row as zeros (its grid covers the padding, not only the longest query), and stores none of them."""
    layer = make_layer(4, 2, 16)
    q, k, v, cache, meta = make_batch([5, 9], [1, 3], layer, block_size=8, dtype=torch.float32,
                                      device=DEVICE, pad_tokens=45)
    assert not meta.is_uniform_decode and meta.max_query_len < 45
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    out = run_paged(q, k, v, cache, meta, layer, fuse_store=True)
    assert torch.equal(cache.cpu(), ref_cache)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)


def graph_layout(meta, extra_seqs):
    """`meta` as a mixed-step graph records it (engine.worker.mixed_graphs): `extra_seqs` empty sequences
    after the real ones, every token row counted, the real token count read on the device."""
    n, device = meta.num_actual_tokens, meta.slot_mapping.device
    qsl = torch.cat([meta.query_start_loc, torch.full((extra_seqs,), n, dtype=torch.int32, device=device)])
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(extra_seqs, dtype=torch.int32, device=device)])
    tables = torch.cat([meta.block_tables, torch.full((extra_seqs, meta.block_tables.shape[1]), SCRATCH_BLOCK,
                                                      dtype=torch.int32, device=device)])
    t = meta.slot_mapping.shape[0]
    return AttentionMetadata(meta.slot_mapping, qsl, seq_lens, tables, num_actual_tokens=t, max_query_len=t,
                             max_seq_len=meta.max_seq_len, is_uniform_decode=False, real_tokens_on_device=True)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_prefill_with_the_real_token_count_on_the_device_matches_the_host_count(window):
    """The mixed-graph layout: empty sequences after the real ones and the padding rows' start read on
    the device give the real rows the same values, zero padding rows and store none of them."""
    layer = make_layer(4, 1, 16, window)
    q, k, v, cache, meta = make_batch([0, 5, 19], [7, 1, 12], layer, block_size=8, dtype=torch.float32,
                                      device=DEVICE, pad_tokens=13)
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    graph_meta = graph_layout(meta, extra_seqs=4)
    ref_graph = torch.full_like(q, float("nan"))
    graph_cache = cache.clone()
    reference.paged_attention(q, k, v, ref_graph, layer, graph_cache, graph_meta)  # the CPU path's own reading
    out = run_paged(q, k, v, cache, graph_meta, layer)
    assert torch.equal(cache.cpu(), ref_cache) and torch.equal(graph_cache.cpu(), ref_cache)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)
    check_close(ref_graph, ref, meta.num_actual_tokens, torch.float32)


def test_paged_prefill_finds_every_query_tile_over_many_sequences_and_empty_ones():
    """More sequences than the launch reads per chunk (16), sequences without query rows among them,
    chunks longer than one query tile: every real row is attended once (the launch's grid counts the
    step's tiles, not the longest chunk times the sequences), padding zero, nothing stored twice."""
    layer = make_layer(2, 1, 16)
    query_lens = [1, 0, 17, 1, 1, 0, 3, 1, 33, 1, 0, 2, 1, 1, 1, 5, 1, 0, 16, 1]
    prefix_lens = [(7 * i) % 23 for i in range(len(query_lens))]
    q, k, v, cache, meta = make_batch(prefix_lens, query_lens, layer, block_size=8, dtype=torch.float32,
                                      device=DEVICE, pad_tokens=5)
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    for laid_out in (meta, graph_layout(meta, extra_seqs=13)):
        tried = cache.clone()
        out = run_paged(q, k, v, tried, laid_out, layer)
        assert torch.equal(tried.cpu(), ref_cache)
        check_close(out, ref, meta.num_actual_tokens, torch.float32)


def test_prefill_launch_without_sequences_still_zeroes_the_padding_rows():
    from custom_ops.triton_prefill import launch_prefill
    q = torch.randn(5, 2, 16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    launch_prefill(q, q, q, out, num_heads=2, num_kv_heads=2, head_dim=16, scale=0.25, sliding_window=None,
                   logit_softcap=None, paged=True, num_seqs=0, max_query_len=0, zero_from=2)
    assert out[:2].isnan().all() and (out[2:] == 0).all()


@pytest.mark.parametrize("window", [None, 9])
def test_paged_prefill_stores_and_reads_new_keys_over_several_query_tiles(window):
    """Chunks longer than one 16-row query tile, after cached prefixes that end mid-tile and mid-page
    (GQA 2): every tile's rows are stored once, and keys on both sides of the cached/new boundary
    are read from the right place."""
    layer = make_layer(4, 2, 16, window)
    q, k, v, cache, meta = make_batch([21, 0], [37, 18], layer, block_size=8, dtype=torch.float32,
                                      device=DEVICE, pad_tokens=2)
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    out = run_paged(q, k, v, cache, meta, layer, fuse_store=True)
    assert torch.equal(cache.cpu(), ref_cache)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)


@pytest.mark.parametrize("fuse_store", [True, False], ids=["fused-store", "store-kernel"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 4.0), (1, None)])
def test_decode_matches_reference(num_splits, window, softcap, fuse_store):
    layer = make_layer(8, 2, 16, window, softcap)  # GQA 4
    q, k, v, cache, meta = make_batch([0, 15, 44], [1, 1, 1], layer, block_size=8, dtype=torch.float32,
                                      device=DEVICE)
    assert meta.is_uniform_decode
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    out = run_paged(q, k, v, cache, meta, layer, num_splits=num_splits, fuse_store=fuse_store)
    assert torch.equal(cache.cpu(), ref_cache)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)


def test_decode_padding_rows_are_zero_and_never_stored():
    """A padded decode batch: the last row is padding, its slot is in the scratch block."""
    layer = make_layer(4, 4, 16)  # no GQA
    q, k, v, cache, meta = make_batch([9, 3], [1, 1], layer, block_size=4, dtype=torch.float16, device=DEVICE,
                                      pad_tokens=1)
    # the padding row is a third "sequence" of length 1 reading only the scratch block
    meta.seq_lens = torch.tensor([10, 4, 1], dtype=torch.int32, device=DEVICE)
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    meta.query_start_loc = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    before = cache.clone()
    out = run_paged(q, k, v, cache, meta, layer, num_splits=2)
    assert torch.equal(cache[:, SCRATCH_BLOCK], before[:, SCRATCH_BLOCK])
    ref, _ = reference_paged(q, k, v, before, meta, layer)
    check_close(out, ref, 2, torch.float16)


@pytest.mark.parametrize("fuse_store", [True, False], ids=["fused-store", "store-kernel"])
@pytest.mark.parametrize("num_splits", [4, 9])
def test_decode_last_split_merges_in_the_same_launch_and_leaves_counters_at_zero(fuse_store, num_splits):
    """4 splits, sequences whose keys fill 1, 2, 3 and 4 of them (tiles of 16 keys under the
    interpreter, 64 on the GPU: the lengths span both): the splits holding keys write partials and
    the last to arrive merges them into out; the arrival counters are 0 again after every launch,
    so a second launch with fresh inputs is right too. With 9 splits up to 7 hold keys: the merge
    takes them four at a time, the last group part empty."""
    from custom_ops import triton_decode
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    layer = make_layer(8, 2, 16)
    for lens in ([9, 20, 40, 64], [70, 130, 200, 1]):
        q, k, v, cache, meta = make_batch([n - 1 for n in lens], [1] * len(lens), layer, block_size=8,
                                          dtype=torch.float32, device=DEVICE)
        ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
        out = run_paged(q, k, v, cache, meta, layer, num_splits=num_splits, fuse_store=fuse_store)
        assert torch.equal(cache.cpu(), ref_cache)
        check_close(out.cpu(), ref, len(lens), torch.float32)
        counters = triton_decode._arrivals[device].buffer
        assert counters.dtype == torch.int32 and not counters.any(), "an arrival counter was left non-zero"


def _fused_views(q, k, v):
    """q, k, v as the models pass them: views of one fused [T, (Hq + 2 Hkv) * D] projection, so all
    three have the fused row stride (Llama rotates q and k in one kernel, whose output q and k view;
    v is not made contiguous)."""
    t = q.shape[0]
    fused = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    qs, ks = q[0].numel(), k[0].numel()
    return (fused[:, :qs].view(q.shape), fused[:, qs:qs + ks].view(k.shape), fused[:, qs + ks:].view(v.shape))


@pytest.mark.parametrize("decode", [True, False], ids=["decode-fused-store", "prefill-store-kernel"])
def test_attention_reads_k_and_v_as_strided_views_of_the_fused_projection(decode):
    from custom_ops.triton_attention import dense_causal_attention
    layer = make_layer(4, 2, 16)
    prefix, query = ([6, 17], [1, 1]) if decode else ([0, 9], [5, 3])
    q, k, v, cache, meta = make_batch(prefix, query, layer, block_size=4, dtype=torch.float32, device=DEVICE)
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    qf, kf, vf = _fused_views(q, k, v)
    assert qf.stride(0) == kf.stride(0) == vf.stride(0) == q[0].numel() + 2 * k[0].numel()
    out = run_paged(qf, kf, vf, cache, meta, layer, num_splits=2 if decode else None)
    assert torch.equal(cache.cpu(), ref_cache)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)
    dense = torch.full_like(q, float("nan"))
    dense_causal_attention(qf, kf, vf, dense, layer)
    check_close(dense.cpu(), reference.causal_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                                        layer), q.shape[0], torch.float32)


def test_num_splits_fill_the_gpu_and_respect_length():
    from custom_ops.triton_decode import decode_num_splits
    assert decode_num_splits(1, 8, 8192, 132) == 33      # batch 1, 8k: ~2 waves of programs
    assert decode_num_splits(32, 8, 4096, 132) == 2
    assert decode_num_splits(256, 8, 4096, 132) == 1
    assert decode_num_splits(1, 8, 300, 132) == 5        # short contexts: >= 64 keys a split
    assert decode_num_splits(1, 1, 4096, 132) == 64      # one kv head (Gemma 3): many small splits
    assert decode_num_splits(1, 1, 1 << 20, 132) == 128  # capped
    # 32-key tiles (head dim 256): one tile a split while that is at most 32 splits, else the 64-key rule
    assert decode_num_splits(1, 1, 512, 132, block_n=32) == 16  # Gemma 3's 512-key window
    assert decode_num_splits(1, 1, 640, 132, block_n=32) == 20
    assert decode_num_splits(1, 1, 4096, 132, block_n=32) == 64
    assert decode_num_splits(64, 1, 512, 132, block_n=32) == 5   # the grid's two waves still bound it
    assert decode_num_splits(1, 8, 512, 132, block_n=64) == 8   # 64-key tiles: the 64-key rule


# ----------------------------------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16]


def _random_case(rng: random.Random, decode: bool):
    d = rng.choice([64, 128, 256])
    group = rng.choice([1, 4, 8])
    hkv = rng.choice([1, 2]) if d == 256 else rng.choice([1, 2, 4])
    block_size = rng.choice([16, 16, 32])
    b = rng.randint(1, 5)
    prefix_lens = [rng.choice([0, block_size, 3 * block_size, rng.randint(1, 300), rng.randint(300, 800)])
                   for _ in range(b)]
    query_lens = [1] * b if decode else [rng.choice([1, block_size, rng.randint(2, 200)]) for _ in range(b)]
    if decode:
        prefix_lens = [max(p, 1) for p in prefix_lens]
    longest = max(p + q for p, q in zip(prefix_lens, query_lens))
    window = rng.choice([None, None, 1, rng.randint(2, 64), block_size, longest, longest + 7,
                         max(1, longest // 2)])
    softcap = rng.choice([None, None, 30.0, 5.0])
    layer = make_layer(hkv * group, hkv, d, window, softcap)
    return layer, block_size, prefix_lens, query_lens, rng.choice(GPU_DTYPES), rng.randint(0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_gpu_paged_random_shapes_match_float64_reference(decode):
    rng = random.Random(1234 + decode)
    failures = []
    for case in range(30):
        layer, block_size, prefix_lens, query_lens, dtype, pad = _random_case(rng, decode)
        q, k, v, cache, meta = make_batch(prefix_lens, query_lens, layer, block_size, dtype, "cuda",
                                          pad_tokens=0 if decode else pad)
        ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
        out = run_paged(q, k, v, cache, meta, layer)
        torch.cuda.synchronize()
        try:
            assert torch.equal(cache.cpu(), ref_cache), "cache differs after the store"
            check_close(out.cpu(), ref, meta.num_actual_tokens, dtype)
        except AssertionError as e:
            failures.append(f"case {case}: {layer} bs={block_size} prefix={prefix_lens} q={query_lens} "
                            f"{dtype}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_decode_any_split_count_matches_reference(num_splits, dtype):
    layer = make_layer(32, 8, 128, None, None)
    q, k, v, cache, meta = make_batch([0, 15, 16, 17, 1000, 4095], [1] * 6, layer, 16, dtype, "cuda")
    ref, _ = reference_paged(q, k, v, cache, meta, layer)
    check_close(run_paged(q, k, v, cache, meta, layer, num_splits=num_splits).cpu(), ref, 6, dtype)


def _compiled_variants(kernel) -> int:
    """How many binaries of a Triton kernel this process compiled for the current device (Triton's
    own per-device cache: its first element is the key -> binary dict in Triton 3.x)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no per-device kernel cache to count")
    entry = caches.get(torch.cuda.current_device())
    return len(entry[0]) if entry else 0


@pytest.mark.gpu
def test_gpu_every_decode_batch_and_prefill_token_count_reuses_one_compiled_variant():
    """A cold start-up compiles once per kernel shape, not per batch size: the counts (Triton would
    specialize an int on == 1 / divisible by 16) and the split count are run-time values."""
    from custom_ops import triton_decode, triton_prefill
    layer = make_layer(24, 8, 128)
    # decode: batch 1..32 with several splits each (2 to 17 at these lengths)
    before = None
    for batch in (1, 2, 3, 8, 16, 24, 32):
        q, k, v, cache, meta = make_batch([500 + i for i in range(batch)], [1] * batch, layer, 16,
                                          torch.bfloat16, "cuda")
        ref, _ = reference_paged(q, k, v, cache, meta, layer)
        check_close(run_paged(q, k, v, cache, meta, layer).cpu(), ref, batch, torch.bfloat16)
        before = _compiled_variants(triton_decode._decode_kernel) if before is None else before
    assert _compiled_variants(triton_decode._decode_kernel) == before
    # prefill: one variant per tile class (triton_prefill.prefill_config: short prompts get smaller
    # tiles), whatever the token count inside it
    counts = []
    for group in ((64, 1, 7, 28, 128), (256, 300, 512), (1024, 2000)):
        for tokens in group:
            q, k, v, cache, meta = make_batch([0], [tokens], layer, 16, torch.bfloat16, "cuda")
            run_paged(q, k, v, cache, meta, layer)
            counts.append(_compiled_variants(triton_prefill._prefill_kernel))
    first = counts[0]
    assert counts == [first] * 5 + [first + 1] * 3 + [first + 2] * 2, counts


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_dense_causal_matches_reference(head_dim, dtype):
    from custom_ops.triton_attention import dense_causal_attention
    for t, group, window, softcap in [(1, 1, None, None), (17, 4, None, None), (128, 8, 1, None),
                                      (300, 4, 64, 30.0), (1000, 1, None, 50.0), (777, 8, 5000, None)]:
        layer = make_layer(2 * group, 2, head_dim, window, softcap)
        q = torch.randn(t, 2 * group, head_dim, dtype=dtype, device="cuda")
        k, v = (torch.randn(t, 2, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        out = torch.full_like(q, float("nan"))
        dense_causal_attention(q, k, v, out, layer)
        ref = reference.causal_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), layer)
        check_close(out.cpu(), ref, t, dtype)


def static_decode_metadata(batch, block_size, max_blocks):
    """A decode step's metadata over static CUDA tensors (one token per sequence), for graphs to record."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.ones(batch, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda"),
        num_actual_tokens=batch, max_query_len=1, max_seq_len=max_blocks * block_size, is_uniform_decode=True)


def fill_decode_step(seed, q, k, v, meta, block_size, max_blocks, num_blocks):
    """New random lengths (the first sequence at 1 token), tables, slots and q/k/v for a decode step's
    static tensors; disjoint pages: two sequences never write one slot, so replay and eager are
    bit-equal."""
    g = torch.Generator().manual_seed(seed)
    batch = q.shape[0]
    lens = torch.randint(1, max_blocks * block_size, (batch,), generator=g)
    lens[0] = 1
    tables = (torch.randperm(num_blocks - 1, generator=g)[: batch * max_blocks] + 1).view(batch, max_blocks)
    slots = tables[torch.arange(batch), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
    meta.seq_lens.copy_(lens)
    meta.block_tables.copy_(tables)
    meta.slot_mapping.copy_(slots)
    for x in (q, k, v):
        x.copy_(torch.randn(x.shape, generator=g).to(q.dtype))


@pytest.mark.gpu
def test_gpu_decode_graph_replay_with_new_metadata_matches_eager():
    """Capture decode at batch 8 with max_seq_len 4096 (split-K), then change lengths, page tables,
    slots and inputs in place: every replay equals an eager call on the same values."""
    from custom_ops import triton_attention
    layer = make_layer(16, 4, 128, None, 20.0)
    batch, block_size, max_blocks, num_blocks = 8, 16, 256, 4096
    dtype = torch.bfloat16
    cache = torch.randn(2, num_blocks, block_size, 4, 128, dtype=dtype, device="cuda")
    q = torch.randn(batch, 16, 128, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, 4, 128, dtype=dtype, device="cuda") for _ in range(2))
    out = torch.empty_like(q)
    meta = static_decode_metadata(batch, block_size, max_blocks)

    def fill(seed):
        fill_decode_step(seed, q, k, v, meta, block_size, max_blocks, num_blocks)

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_attention.paged_attention(q, k, v, out, layer, cache, meta)  # warm-up compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention.paged_attention(q, k, v, out, layer, cache, meta)
    for seed in (1, 2, 3):
        fill(seed)
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        eager = torch.full_like(out, float("nan"))
        triton_attention.paged_attention(q, k, v, eager, layer, cache, meta)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
        ref, _ = reference_paged(q, k, v, cache, meta, layer)
        check_close(replayed.cpu(), ref, batch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 24])
def test_gpu_mixed_step_graph_replays_any_step_up_to_its_size(window):
    """One graph of the prefill launch over 48 token rows and 6 sequence rows (the mixed-graph layout),
    replayed for steps of other sequence counts, lengths and real token counts written in place: each
    replay equals an eager launch on the same values and the float64 reference, padding rows zero."""
    from custom_ops import triton_attention
    layer = make_layer(8, 2, 64, window)
    t, max_seqs, width, block_size, dtype = 48, 6, 8, 16, torch.bfloat16
    steps = [([0, 5, 19], [7, 1, 12]), ([40], [30]), ([2, 0, 3, 9, 70, 1], [1, 16, 1, 4, 2, 9]), ([64, 0], [1, 1])]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks, block_size, 2, 64, dtype=dtype, device="cuda")
    q = torch.zeros(t, 8, 64, dtype=dtype, device="cuda")
    k, v = (torch.zeros(t, 2, 64, dtype=dtype, device="cuda") for _ in range(2))
    static = graph_layout(make_batch([0], [t], layer, block_size, dtype, "cuda")[4], max_seqs - 1)
    static.block_tables = torch.zeros(max_seqs, width, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def load(prefix_lens, query_lens):
        n = sum(query_lens)
        bq, bk, bv, bcache, meta = make_batch(prefix_lens, query_lens, layer, block_size, dtype, "cuda",
                                              pad_tokens=t - n)
        cache.zero_()
        cache[:, :bcache.shape[1]] = bcache
        for dst, src in ((q, bq), (k, bk), (v, bv)):
            dst.copy_(src)
        laid_out = graph_layout(meta, max_seqs - len(query_lens))
        static.slot_mapping.copy_(laid_out.slot_mapping)
        static.query_start_loc.copy_(laid_out.query_start_loc)
        static.seq_lens.copy_(laid_out.seq_lens)
        static.block_tables.fill_(SCRATCH_BLOCK)
        static.block_tables[:, :laid_out.block_tables.shape[1]] = laid_out.block_tables
        return meta, cache.clone()

    load(*steps[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_attention.paged_attention(q, k, v, out, layer, cache, static)  # warm-up compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention.paged_attention(q, k, v, out, layer, cache, static)
    for prefix_lens, query_lens in steps:
        meta, before = load(prefix_lens, query_lens)
        out.fill_(float("nan"))
        graph.replay()
        replayed, after_replay = out.clone(), cache.clone()
        cache.copy_(before)
        eager = run_paged(q, k, v, cache, static, layer)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager) and torch.equal(after_replay, cache)
        ref, ref_cache = reference_paged(q, k, v, before, meta, layer)
        assert torch.equal(after_replay.cpu(), ref_cache)
        check_close(replayed.cpu(), ref, meta.num_actual_tokens, dtype)


@pytest.mark.gpu
def test_gpu_decode_graphs_of_two_sizes_share_the_split_workspace_and_a_graph_without_one_uses_temporaries():
    """The engine's decode-graph pattern on the kernel alone: graphs at batch 8 then 4 captured into one
    pool record slices of the device's one split workspace (partials and arrival counters); a graph
    captured while the device has no workspace yet takes zeroed temporaries from its graph pool.
    Replayed in turn with new lengths, tables and slots (sliding window, split-K, fused store), each
    equals an eager call on the same values and the float64 reference, and the shared arrival
    counters are 0 after every replay."""
    from custom_ops import triton_attention, triton_decode
    device = torch.device("cuda", torch.cuda.current_device())
    layer = make_layer(16, 2, 128, 700, None)  # every size gets 11 splits on an H100 (visible keys: 700)
    block_size, max_blocks, num_blocks, dtype = 16, 128, 4096, torch.bfloat16
    cache = torch.randn(2, num_blocks, block_size, 2, 128, dtype=dtype, device="cuda")

    def static(batch):
        q = torch.randn(batch, 16, 128, dtype=dtype, device="cuda")
        k, v = (torch.randn(batch, 2, 128, dtype=dtype, device="cuda") for _ in range(2))
        meta = static_decode_metadata(batch, block_size, max_blocks)
        return q, k, v, torch.empty_like(q), meta

    def fill(seed, q, k, v, meta):
        fill_decode_step(seed, q, k, v, meta, block_size, max_blocks, num_blocks)

    sizes = (8, 4, 2)
    bufs = {b: static(b) for b in sizes}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in sizes:  # compiles, and sizes the device's workspace outside any capture
            fill(0, *bufs[b][:3], bufs[b][4])
            triton_attention.paged_attention(*bufs[b][:4], layer, cache, bufs[b][4])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    shared_counters = triton_decode._arrivals[device].buffer
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    saved = None
    try:
        for b in sizes:  # largest first, as DecodeGraphs captures
            if b == 2:  # no workspace on the device: this capture takes temporaries from the pool
                saved = triton_decode._workspaces.pop(device), triton_decode._arrivals.pop(device)
            graphs[b] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[b], pool=pool):
                triton_attention.paged_attention(*bufs[b][:4], layer, cache, bufs[b][4])
        assert triton_decode._workspaces[device].buffer is None, "a capture grew the shared workspace"
        for seed in (1, 2, 3):
            for b in (4, 8, 2, 8):
                q, k, v, out, meta = bufs[b]
                fill(seed * 10 + b, q, k, v, meta)
                out.fill_(float("nan"))
                graphs[b].replay()
                torch.cuda.synchronize()
                assert not shared_counters.any(), f"batch {b}: an arrival counter was left non-zero"
                replayed = out.clone()
                eager = torch.full_like(out, float("nan"))
                triton_attention.paged_attention(q, k, v, eager, layer, cache, meta)
                torch.cuda.synchronize()
                assert torch.equal(replayed, eager), f"batch {b}: the replay differs from an eager call"
                ref, _ = reference_paged(q, k, v, cache, meta, layer)
                check_close(replayed.cpu(), ref, b, dtype)
    finally:
        if saved is not None:  # the module's workspaces again (graphs 8 and 4 recorded their buffers)
            triton_decode._workspaces[device], triton_decode._arrivals[device] = saved
        graphs.clear()


@pytest.mark.gpu
def test_gpu_op_dispatches_to_triton_with_and_without_context():
    from custom_ops import forward_context, register_attention_layer
    layer = make_layer(8, 2, 64, 32, None)
    register_attention_layer("test_triton.op", layer)
    q, k, v, cache, meta = make_batch([40, 0], [9, 33], layer, 16, torch.bfloat16, "cuda", pad_tokens=2)
    ref, ref_cache = reference_paged(q, k, v, cache, meta, layer)
    out = torch.full_like(q, float("nan"))
    with forward_context(meta, kv_caches={"test_triton.op": cache}):
        torch.ops.infer.attention(q, k, v, out, "test_triton.op")
    check_close(out.cpu(), ref, meta.num_actual_tokens, torch.bfloat16)
    dense_out = torch.full_like(q, float("nan"))
    torch.ops.infer.attention(q, k, v, dense_out, "test_triton.op")
    dense_ref = reference.causal_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), layer)
    check_close(dense_out.cpu(), dense_ref, q.shape[0], torch.bfloat16)


def test_decode_split_scratch_is_one_buffer_per_device_sliced_for_every_shape():
    """Decodes at several batch sizes and split counts share ONE workspace (no buffer per shape),
    and still match the reference."""
    from custom_ops import triton_decode
    device = torch.device(DEVICE)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    before = triton_decode._workspaces.get(device)
    before_floats = before.buffer.numel() if before is not None else 0
    layer = make_layer(8, 2, 16)
    for lens, splits in (([15, 44], 3), ([9], 2), ([3, 20, 7], 3)):
        q, k, v, cache, meta = make_batch([n - 1 for n in lens], [1] * len(lens), layer, block_size=8,
                                          dtype=torch.float32, device=DEVICE)
        ref, _ = reference_paged(q, k, v, cache, meta, layer)
        check_close(run_paged(q, k, v, cache, meta, layer, num_splits=splits), ref, len(lens), torch.float32)
    assert set(triton_decode._workspaces) == {device}
    workspace = triton_decode._workspaces[device]
    largest_need = 3 * 8 * 3 * (16 + 2)
    if device.type == "cpu":  # no SM count: sized exactly to the largest need so far
        assert workspace.buffer.numel() == max(before_floats, largest_need)
    else:
        assert workspace.buffer.numel() >= largest_need


def test_split_workspace_grows_only_when_needed_and_keeps_what_a_graph_recorded():
    from custom_ops.workspace import Workspace
    cpu = torch.device("cpu")
    workspace = Workspace()
    first = workspace.take(100, 1000, cpu)
    assert workspace.take(500, 1000, cpu).data_ptr() == first.data_ptr() and workspace.buffer.numel() == 1000
    workspace.captured = True  # as if a graph had recorded it: replacing it must keep it alive
    assert workspace.take(2000, 1000, cpu).numel() == 2000 and workspace.buffer.numel() == 2000
    assert len(workspace.retired) == 1 and workspace.retired[0].data_ptr() == first.data_ptr()


def test_a_prefill_plan_binds_exactly_what_differs_between_layers_of_a_kind(monkeypatch):
    """Per step and layer kind a prefill launch is planned once (custom_ops.triton_attention): a later
    layer's planned launch must equal the launch derived from scratch for that layer, argument by
    argument, and a layer of another kind or with an unaligned tensor never takes another's plan. The
    launches are recorded, not run (the plan path is the GPU's; its kernels run in the GPU tests)."""
    from custom_ops import triton_attention, triton_launch, triton_prefill
    derived, planned = [], []
    monkeypatch.setattr(triton_prefill, "launch", lambda kernel, grid, args, options: derived.append((grid, args)))
    monkeypatch.setattr(triton_launch, "fast_path_open", lambda kernel: True)
    monkeypatch.setattr(triton_launch, "variant", lambda kernel, args, options: "variant")
    monkeypatch.setattr(triton_launch, "run_variant", lambda entry, grid, args: planned.append((grid, tuple(args))))
    monkeypatch.setattr(triton_attention, "_plans", {})
    full, sliding = make_layer(4, 2, 16), make_layer(4, 2, 16, window=5)
    _, _, _, cache, meta = make_batch([0, 5, 19], [7, 1, 12], full, block_size=8, dtype=torch.float32,
                                      device="cpu", pad_tokens=3)

    def layer_tensors(seed):
        g = torch.Generator().manual_seed(seed)
        t = meta.slot_mapping.shape[0]
        qkv = torch.randn(t, 8, 16, generator=g)  # v a strided view of a fused projection, as in the models
        return qkv[:, :4].contiguous(), qkv[:, 4:6].contiguous(), qkv[:, 6:], torch.empty(t, 4, 16), cache.clone()

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                    and a.stride() == b.stride() and a.dtype == b.dtype)
        return a == b and type(a) is type(b)

    layers = [layer_tensors(seed) for seed in range(3)]
    triton_attention.paged_attention(*layers[0][:4], full, layers[0][4], meta)  # derives, and plans
    assert len(derived) == 1 and not planned
    for q, k, v, out, kv in layers[1:]:
        triton_attention.paged_attention(q, k, v, out, full, kv, meta)
        grid, args = planned.pop()
        triton_attention._plans.clear()  # the same launch derived from scratch
        triton_attention.paged_attention(q, k, v, out, full, kv, meta)
        assert grid == derived[-1][0] and len(args) == len(derived[-1][1])
        assert all(same(a, b) for a, b in zip(args, derived[-1][1]))
    assert not planned
    triton_attention.paged_attention(*layers[1][:4], sliding, layers[1][4], meta)  # another kind: derived
    q, k, v, out, kv = layers[2]
    unaligned = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)  # 4 bytes off: another variant
    triton_attention.paged_attention(unaligned, k, v, out, full, kv, meta)
    assert not planned and len(derived) == 5
