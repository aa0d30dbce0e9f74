"""Triton prefill / extend attention: variable-length queries, causal over cached prefix + new tokens.

One program owns ``BLOCK_M`` query rows of one sequence and one query head, and streams that
sequence's keys in ``BLOCK_N`` tiles with an online softmax (flash-attention style). Keys come
either from the paged cache (``PAGED``) or from dense ``k, v [T, Hkv, D]`` (the op without a forward
context: one sequence at positions ``0..T-1``). Paged with ``FUSE_STORE``, the same launch stores the
step's new K/V: the cached prefix is read from the cache, the sequence's new tokens straight from
``k, v``, and the first query head of each kv group writes its rows' keys and values to their slots
(no program of the launch reads a new token's slot, so there is no race). Without it the new tokens
were stored by a separate kernel first and every key is read from the cache.

Query row ``i`` of a sequence with ``q_len`` new tokens and ``seq_len`` total sits at position
``seq_len - q_len + i`` and sees key ``kp`` iff ``0 <= pos - kp < window``. The key range of a tile is
cut in three loops: the window's lower edge (masked), the interior every row sees (no mask), and the
diagonal (masked), so most tiles skip the mask arithmetic. Tiles with the most work (last rows) are
launched first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton_common import cdiv, interpreting, load_kv_tile, log2_scores, next_power_of_2
from custom_ops.triton_launch import launch


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, q_pos, start, end,
    k_ptr, v_ptr, block_table_ptr, kv_head,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh,
    offs_d, d_mask, scale, softcap, window,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOURCE: tl.constexpr,
):
    """Keys [start, end) into the running softmax. SOURCE 0: the cache (or dense k/v); 1: the new
    k/v (pointers offset so that position p reads its token's row), in the cache's dtype, as if
    they had been stored first."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        n = start_n + offs_n
        n_valid = n < end
        if SOURCE == 1:  # new tokens only: dense rows of k/v
            k, v = load_kv_tile(
                k_new_ptr, v_new_ptr, block_table_ptr, n, n_valid, kv_head,
                0, stride_knt, stride_knh, 0, stride_vnt, stride_vnh, offs_d, d_mask,
                PAGE_SIZE=PAGE_SIZE, PAGED=False, MASKED=MASKED, EVEN_D=EVEN_D)
            k, v = k.to(k_ptr.dtype.element_ty), v.to(v_ptr.dtype.element_ty)
        else:
            k, v = load_kv_tile(
                k_ptr, v_ptr, block_table_ptr, n, n_valid, kv_head,
                stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, offs_d, d_mask,
                PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=MASKED, EVEN_D=EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = log2_scores(s, scale, softcap, SOFTCAP=SOFTCAP)
        if MASKED:
            distance = q_pos[:, None] - n[None, :]
            visible = (distance >= 0) & n_valid[None, :]
            if WINDOW:
                visible = visible & (distance < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row may see nothing in this tile (window edge): keep its running max finite so
            # exp2(-inf - -inf) never makes a NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_span(
    acc, l_i, m_i, q, q_pos, start, end,
    k_ptr, v_ptr, block_table_ptr, kv_head,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, cached_end,
    offs_d, d_mask, scale, softcap, window,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSE_STORE: tl.constexpr,
):
    """Keys [start, end), under FUSE_STORE from the cache below cached_end and from the new k/v
    from there on. An unmasked span stays unmasked in whole tiles from its start: its cached tiles,
    the tile across cached_end (as two masked partial tiles, one per source) and its new tiles."""
    if FUSE_STORE:
        if MASKED:
            boundary = tl.maximum(tl.minimum(cached_end, end), start)
            cut = boundary
            new_from = boundary
        else:
            cut = tl.minimum(start + (tl.maximum(cached_end - start, 0) // BLOCK_N) * BLOCK_N, end)
            new_from = tl.minimum(cut + BLOCK_N, end)
            boundary = tl.maximum(tl.minimum(cached_end, new_from), cut)
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, start, cut, k_ptr, v_ptr, block_table_ptr, kv_head,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, offs_d, d_mask,
            scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=MASKED,
            EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, SOURCE=0)
        if not MASKED:  # the boundary tile: its cached part, then its new part, both masked
            acc, l_i, m_i = _attend_keys(
                acc, l_i, m_i, q, q_pos, cut, boundary, k_ptr, v_ptr, block_table_ptr, kv_head,
                stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, offs_d, d_mask,
                scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=True,
                EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, SOURCE=0)
            acc, l_i, m_i = _attend_keys(
                acc, l_i, m_i, q, q_pos, boundary, new_from, k_ptr, v_ptr, block_table_ptr, kv_head,
                stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, offs_d, d_mask,
                scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=True,
                EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, SOURCE=1)
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, new_from, end, k_ptr, v_ptr, block_table_ptr, kv_head,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, offs_d, d_mask,
            scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=MASKED,
            EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, SOURCE=1)
    else:
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, q_pos, start, end, k_ptr, v_ptr, block_table_ptr, kv_head,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, offs_d, d_mask,
            scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=MASKED,
            EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, SOURCE=0)
    return acc, l_i, m_i


# num_stores, dense_len and the padding rows' bounds are token counts: specialized (== 1, divisible by
# 16, other) they would cost a compile per class of capture size on a cold start-up, for loop bounds
# and masks.
@triton.jit
def _find_tile(tile, query_start_loc_ptr, num_seqs, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, its query tile) of the step's `tile`-th query tile, counting every sequence's
    cdiv(q_len, BLOCK_M) tiles in order; sequence num_seqs where the step has fewer tiles. Reads
    query_start_loc in chunks of BLOCK_S sequences (one compile for any sequence count)."""
    seq = num_seqs + 0 * tile
    first_tile = 0 * tile
    before = 0 * tile  # tiles of the chunks already read
    for chunk in range(0, num_seqs, BLOCK_S):
        offs = chunk + tl.arange(0, BLOCK_S)
        valid = offs < num_seqs
        starts = tl.load(query_start_loc_ptr + offs, mask=valid, other=0)
        ends = tl.load(query_start_loc_ptr + offs + 1, mask=valid, other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        ends_at = before + tl.cumsum(tiles, 0)  # tiles up to and including each sequence
        # the first sequence whose tiles end past `tile` owns it (an empty one never ends past it first)
        owner = tl.min(tl.where(valid & (ends_at > tile), offs, num_seqs), 0)
        owner_first = tl.sum(tl.where(offs == owner, ends_at - tiles, 0), 0)
        take = (seq == num_seqs) & (owner < num_seqs)
        first_tile = tl.where(take, owner_first, first_tile)
        seq = tl.where(take, owner, seq)
        before += tl.sum(tiles, 0)
    return seq, tile - first_tile


@triton.jit(do_not_specialize=["num_stores", "dense_len", "pad_start", "pad_end", "num_seqs"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    k_new_ptr, v_new_ptr, slot_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    stride_knt, stride_knh, stride_vnt, stride_vnh, num_stores,
    dense_len, pad_start, pad_end, scale, softcap, window, num_seqs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSE_STORE: tl.constexpr, PAD_START_ON_DEVICE: tl.constexpr = False, BLOCK_S: tl.constexpr = 16,
):
    head = tl.program_id(0)
    # Paged, axis 1 counts the step's query tiles over all sequences (most work first: the last
    # sequence's last tile, which sees the most keys) and axis 2 is 0, or 1 for the padding rows'
    # programs; dense (one sequence), axis 1 its query tiles.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if pad_end > pad_start:
        # Axis 2's last index: the step's padding rows [pad_start, pad_end), which read nothing and
        # are written as zeros here (a separate fill per layer was a host launch between pieces).
        if tl.program_id(2) == tl.num_programs(2) - 1:
            m_tile = tile
            if PAD_START_ON_DEVICE:  # where the step's real rows end: query_start_loc[num_seqs]
                pad_start = tl.load(query_start_loc_ptr + num_seqs)
            pad_rows = pad_start + m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
            pad_mask = (pad_rows < pad_end)[:, None] & d_mask[None, :]
            tl.store(out_ptr + pad_rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                     tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=pad_mask)
            return
    if PAGED:
        seq, m_tile = _find_tile(tile, query_start_loc_ptr, num_seqs, BLOCK_M=BLOCK_M, BLOCK_S=BLOCK_S)
        if seq >= num_seqs:
            return
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq = tl.program_id(2)  # 0: the one sequence
        m_tile = tile
        q_start = 0
        q_len = dense_len
        seq_len = dense_len
    if m_tile * BLOCK_M >= q_len:
        return
    kv_head = head // GROUP
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    offs_m = tl.arange(0, BLOCK_M)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    rows = m_tile * BLOCK_M + offs_m
    row_valid = rows < q_len
    q_pos = seq_len - q_len + rows
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    cached_end = seq_len - q_len  # the new tokens are positions [cached_end, seq_len)
    if FUSE_STORE:
        # Row r of this sequence's new tokens is token q_start + r: position p reads token row
        # p - cached_end + q_start through these offset pointers.
        k_new_seq = k_new_ptr + (q_start - cached_end).to(tl.int64) * stride_knt
        v_new_seq = v_new_ptr + (q_start - cached_end).to(tl.int64) * stride_vnt
        if head % GROUP == 0:  # one query head per kv group stores its rows' K/V
            store_rows = row_valid & (tokens < num_stores)  # padding tokens write nothing
            slots = tl.load(slot_ptr + tokens, mask=store_rows, other=-1).to(tl.int64)
            store_rows = store_rows & (slots >= 0)
            kv_mask = store_rows[:, None] & d_mask[None, :]
            k_rows = tl.load(k_new_ptr + tokens[:, None] * stride_knt + kv_head * stride_knh + offs_d[None, :],
                             mask=kv_mask, other=0.0)
            v_rows = tl.load(v_new_ptr + tokens[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                             mask=kv_mask, other=0.0)
            page = slots // PAGE_SIZE
            in_page = slots % PAGE_SIZE
            tl.store(k_ptr + (page * stride_kb + in_page * stride_ko + kv_head * stride_kh)[:, None] + offs_d[None, :],
                     k_rows.to(k_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_ptr + (page * stride_vb + in_page * stride_vo + kv_head * stride_vh)[:, None] + offs_d[None, :],
                     v_rows.to(v_ptr.dtype.element_ty), mask=kv_mask)
    else:
        k_new_seq = k_new_ptr
        v_new_seq = v_new_ptr

    first_pos = seq_len - q_len + m_tile * BLOCK_M
    last_pos = first_pos + BLOCK_M - 1  # counts rows past q_len too: only makes masking safer
    hi = tl.minimum(seq_len, last_pos + 1)
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, lo)
    else:
        lo = 0
        full_lo = 0
    # [lo, edge_end): window edge, masked; [edge_end, diag_start): every row sees every key;
    # [diag_start, hi): causal diagonal, masked.
    edge_end = tl.minimum(lo + tl.cdiv(full_lo - lo, BLOCK_N) * BLOCK_N, hi)
    diag_start = edge_end + (tl.maximum(first_pos + 1 - edge_end, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:
        acc, l_i, m_i = _attend_span(
            acc, l_i, m_i, q, q_pos, lo, edge_end, k_ptr, v_ptr, block_table_ptr, kv_head,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            k_new_seq, v_new_seq, stride_knt, stride_knh, stride_vnt, stride_vnh, cached_end, offs_d, d_mask,
            scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=True,
            EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, FUSE_STORE=FUSE_STORE)
    acc, l_i, m_i = _attend_span(
        acc, l_i, m_i, q, q_pos, edge_end, diag_start, k_ptr, v_ptr, block_table_ptr, kv_head,
        stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
        k_new_seq, v_new_seq, stride_knt, stride_knh, stride_vnt, stride_vnh, cached_end, offs_d, d_mask,
        scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=False,
        EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, FUSE_STORE=FUSE_STORE)
    acc, l_i, m_i = _attend_span(
        acc, l_i, m_i, q, q_pos, diag_start, hi, k_ptr, v_ptr, block_table_ptr, kv_head,
        stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
        k_new_seq, v_new_seq, stride_knt, stride_knh, stride_vnt, stride_vnh, cached_end, offs_d, d_mask,
        scale, softcap, window, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASKED=True,
        EVEN_D=EVEN_D, SOFTCAP=SOFTCAP, WINDOW=WINDOW, DOT_PRECISION=DOT_PRECISION, FUSE_STORE=FUSE_STORE)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


# Up to this many query rows per sequence, short-prefill tiles: many small programs. The long-prefill
# tiles were swept on long sequences, where they are compute-bound; for a short prompt their grid is a
# few dozen programs (24 heads x 1 row tile at 64 tokens) on 132 SMs. Paged prefill per layer on an H100
# (bench/results/h100-2026-11-26/prefill-tiles), the long tiles -> these: llama heads (24/8, D 128)
# 25.2 -> 11.1 us at 64 tokens, 31.3 -> 18.4 at 256, 39.6 -> 27.8 at 512; gemma-3 sliding heads (4/1,
# D 256) 52.3 -> 14.5, 47.6 -> 21.2, 53.8 -> 30.1. Longer prompts were not swept with these tiles.
SHORT_PREFILL_ROWS = 512


def prefill_config(head_dim: int, dtype: torch.dtype = torch.bfloat16, max_query_len: int | None = None) -> dict:
    """Tile shapes per head dim (swept on an H100; see bench/NOTES_attention.md), and for head dims above
    64 per prompt length when `max_query_len` is given (SHORT_PREFILL_ROWS)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # twice the shared memory per tile: smaller tiles, same code
        if head_dim <= 64:
            return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        if head_dim <= 128:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    if max_query_len is not None and max_query_len <= SHORT_PREFILL_ROWS and head_dim > 64:  # 64: not swept
        if head_dim > 128 or max_query_len <= 128:
            return dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=3)
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (fp32 models, CPU tests) get full-precision dots; 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_prefill(
    q: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor, out: torch.Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
    sliding_window: int | None, logit_softcap: float | None,
    paged: bool, num_seqs: int, max_query_len: int, dense_len: int = 0,
    block_tables: torch.Tensor | None = None, query_start_loc: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None, page_size: int = 1, config: dict | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None, zero_from: int | None = None,
    zero_tail_on_device: bool = False,
) -> tuple[tuple[int, int, int], tuple, dict] | None:
    """Launch the prefill kernel. Paged: ``k_src/v_src`` are ``cache[0]/cache[1]`` ``[NB, BS, Hkv, D]``;
    dense: ``[T, Hkv, D]`` with ``dense_len = T`` and ``num_seqs = 1``.

    Paged, ``new_kv = (k, v, slot_mapping, num_tokens)`` fuses the store: the new tokens' keys are
    read from ``k, v`` and written to their slots by the same launch (the cache need not hold them).
    ``zero_from``: out's rows from there on are padding (no sequence owns them); the launch writes them
    as zeros. ``zero_tail_on_device``: the same from ``query_start_loc[num_seqs]`` on, read by the launch
    when it runs (a graph replayed for steps of any real token count up to out's rows).

    Returns the launch it made, (grid, positional arguments, keyword options) of `_prefill_kernel`,
    or None where there was nothing to launch."""
    if new_kv is not None and not paged:
        raise ValueError("launch_prefill: new_kv (a fused store) needs the paged cache")
    cfg = dict(prefill_config(head_dim, q.dtype, max_query_len))
    cfg.update(config or {})
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    if max_query_len <= 0 or num_seqs <= 0:
        if zero_from is not None and paged and zero_from < out.shape[0]:
            out[zero_from:].zero_()  # nothing to attend; the padding rows are still written
        return None
    if paged:
        stride_kb, stride_ko, stride_kh = k_src.stride()[:3]
        stride_vb, stride_vo, stride_vh = v_src.stride()[:3]
        stride_bt = block_tables.stride(0)
    else:
        stride_kb, stride_ko, stride_kh = 0, k_src.stride(0), k_src.stride(1)
        stride_vb, stride_vo, stride_vh = 0, v_src.stride(0), v_src.stride(1)
        block_tables = query_start_loc = seq_lens = q  # unused pointers under PAGED=False
        stride_bt = 0
    if new_kv is not None:
        k_new, v_new, slots, num_stores = new_kv
    else:
        k_new = v_new = slots = q  # unused under FUSE_STORE=False
        num_stores = 0
    if zero_tail_on_device and not paged:
        raise ValueError("launch_prefill: zero_tail_on_device needs the paged layout (query_start_loc)")
    if zero_tail_on_device:
        pad_start, pad_end = 0, out.shape[0]  # the kernel reads the real start
    else:
        pad_start, pad_end = (zero_from, out.shape[0]) if zero_from is not None and paged else (0, 0)
    if paged:
        # every sequence's tiles: at most one partial tile per sequence past the whole ones of all rows
        num_tiles = min(out.shape[0] // block_m + num_seqs, num_seqs * cdiv(max_query_len, block_m))
    else:
        num_tiles = cdiv(max_query_len, block_m)
    if pad_end > pad_start:  # axis 2's second index: the programs that zero the padding rows
        grid = (num_heads, max(num_tiles, cdiv(pad_end - pad_start, block_m)), 2)
    else:
        grid = (num_heads, num_tiles, 1)
    q_strides, out_strides = q.stride(), out.stride()
    k_new_strides, v_new_strides = k_new.stride(), v_new.stride()
    args = (
        q, k_src, v_src, out, block_tables, query_start_loc, seq_lens, k_new, v_new, slots,
        q_strides[0], q_strides[1], out_strides[0], out_strides[1],
        stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
        k_new_strides[0], k_new_strides[1], v_new_strides[0], v_new_strides[1], num_stores,
        dense_len, pad_start, pad_end, float(scale), float(logit_softcap or 1.0), int(sliding_window or 0),
        num_seqs,
    )
    options = dict(
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size, PAGED=paged,
        SOFTCAP=bool(logit_softcap), WINDOW=bool(sliding_window), DOT_PRECISION=dot_precision(q.dtype),
        FUSE_STORE=new_kv is not None, PAD_START_ON_DEVICE=zero_tail_on_device, **cfg,
    )
    launch(_prefill_kernel, grid, args, options)
    return grid, args, options
