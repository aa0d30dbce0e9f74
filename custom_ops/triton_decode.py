"""Triton split-K decode attention over the paged KV cache (one query token per sequence).

Grid ``(num_seqs, num_kv_heads, num_splits)``: every program serves all ``Hq / Hkv`` query heads of
its kv head (the group's queries form the M side of one ``tl.dot``), so each key/value byte is read
once per step, which is what bounds decode. A sequence's visible keys
``[max(0, seq_len - window), seq_len)`` are cut into ``num_splits`` equal runs of whole
``BLOCK_N`` tiles; keys before the window are never loaded. The splits that hold keys are the
sequence's active splits. With one active split (a short sequence, or ``num_splits == 1``) that
split normalizes and writes ``out`` itself. Otherwise each active split writes its unnormalized
accumulator, running max and sum to scratch and bumps a per-(sequence, kv head) arrival counter; the
split that arrives last merges the partials into ``out`` and zeroes the counter for the next launch.
So decode attention is ONE launch whatever the split count (a separate merge kernel cost a launch
per layer and the drain between the two).

With ``rotary`` (custom_ops.rope.QKRotary) q and the new key arrive raw, as the q/k projection wrote
them: every program normalizes (Qwen3, Gemma 3) and rotates its query heads' one row and the newest
key row itself, in the rounding order of the q/k norm + rotary kernel, and the split that stores the
key stores it rotated. That kernel's launch and its gap to this one were ~1.7 us of a layer
(knockout), against a few hundred extra flops per program here.

The grid depends only on python ints the caller fixes (batch size, heads, and ``num_splits`` from
``max_seq_len``), and lengths and page tables are read from device tensors, so the launch is CUDA-graph
capturable and a replay with new metadata values stays correct.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.pdl import launch_with_pdl, pdl_launch_options
from custom_ops.rope import QKRotary
from custom_ops.triton_common import cdiv, interpreting, load_kv_tile, log2_scores, next_power_of_2, sm_count
from custom_ops.triton_launch import launch
from custom_ops.triton_prefill import dot_precision
from custom_ops.triton_rms_norm import scale_normed
from custom_ops.workspace import Workspace


@triton.jit
def _load_partial(part_max_ptr, part_sum_ptr, part_acc_ptr, rows, s, active, g_mask, offs_d, BLOCK_D: tl.constexpr):
    """Split s's (max, sum, accumulator) of the query heads at `rows`; a split past `active` reads as
    (-inf, 0, 0), which weighs nothing. Read from L2 (.cg): never a stale L1 line."""
    mask = g_mask & ((rows * 0 + s) < active)  # a vector: the interpreter refuses scalar masks
    m = tl.load(part_max_ptr + rows + s, mask=mask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_sum_ptr + rows + s, mask=mask, other=0.0, cache_modifier=".cg")
    acc = tl.load(part_acc_ptr + (rows + s)[:, None] * BLOCK_D + offs_d[None, :], mask=mask[:, None], other=0.0,
                  cache_modifier=".cg")
    return m, l, acc


# The batch size reaches the kernel as num_stores and num_splits. Triton would compile a variant per
# value class of an int argument (== 1, divisible by 16, other), so every decode batch size and
# split count would cost a compile on a cold start-up (about 1 s each on an H100 host); at run time
# they only bound loops and masks. SPLIT (one split or several) is the only shape of the code.
@triton.jit
def _norm_rope_rows(x, x_partner, w, w_partner, cos, sin, sign, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
                    UNIT_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """Rows x [R, BLOCK_D] (float32, zeros past HEAD_DIM) normalized over HEAD_DIM (with NORM) and
    rotated: out[d] = x[d] cos[d] + sign[d] x[partner(d)] sin[d], with partner(d) = d +- HEAD_DIM / 2.
    Rounded as custom_ops.triton_rope rounds: the norm's output to dtype, the rotation once."""
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = scale_normed(x * inv_rms, w, UNIT_OFFSET, dtype).to(tl.float32)
        x_partner = scale_normed(x_partner * inv_rms, w_partner, UNIT_OFFSET, dtype).to(tl.float32)
    return (x * cos + sign * (x_partner * sin)).to(dtype)


@triton.jit(do_not_specialize=["num_stores", "num_splits"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr, k_new_ptr, v_new_ptr, slot_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    stride_knt, stride_knh, stride_vnt, stride_vnh, num_stores, num_splits,
    scale, softcap, window,
    cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, stride_cos, stride_sin, norm_eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FUSE_STORE: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW:
        start = tl.maximum(seq_len - window, 0)
    else:
        start = 0
    num_tiles = tl.cdiv(seq_len - start, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    # Splits past the keys hold nothing and take no part; a sequence of length 0 (padding) has one.
    active = tl.maximum(tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1)), 1)
    begin = start + split * tiles_per_split * BLOCK_N
    end = tl.minimum(begin + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    qo_mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    seq64 = seq.to(tl.int64)
    if ROPE:
        half: tl.constexpr = HEAD_DIM // 2
        first_half = offs_d < half
        partner = tl.where(first_half, offs_d + half, offs_d - half)
        sign = tl.where(first_half, -1.0, 1.0)[None, :]
        if QK_NORM:  # the layer's own weights: loaded before the PDL wait
            q_w = tl.load(q_norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            q_w_partner = tl.load(q_norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            k_w = tl.load(k_norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            k_w_partner = tl.load(k_norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        else:
            q_w = sign  # unread without QK_NORM
            q_w_partner = sign
            k_w = sign
            k_w_partner = sign
    if PDL:
        # The step's lengths and page tables were copied in before the step's first kernel; q and
        # the new K/V are the previous kernel's output, and nothing is written before this wait.
        tl.extra.cuda.gdc_wait()
    q_rows = q_ptr + seq64 * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=qo_mask, other=0.0)
    if ROPE:
        dtype = q.dtype
        rot = tl.where(first_half, offs_d, offs_d - half)
        cos = tl.load(cos_ptr + seq64 * stride_cos + rot, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + seq64 * stride_sin + rot, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        q_partner = tl.load(q_rows + partner[None, :], mask=qo_mask, other=0.0).to(tl.float32)
        q = _norm_rope_rows(q.to(tl.float32), q_partner, q_w, q_w_partner, cos, sin, sign, norm_eps,
                            HEAD_DIM, QK_NORM, UNIT_OFFSET, dtype)
        if FUSE_STORE:  # the newest key, as a [1, BLOCK_D] row: attended by one split, stored by one
            k_new_base = k_new_ptr + seq64 * stride_knt + kv_head * stride_knh
            k_raw = tl.load(k_new_base + offs_d[None, :], mask=d_mask[None, :], other=0.0).to(tl.float32)
            k_partner = tl.load(k_new_base + partner[None, :], mask=d_mask[None, :], other=0.0).to(tl.float32)
            k_rotated = _norm_rope_rows(k_raw, k_partner, k_w, k_w_partner, cos, sin, sign, norm_eps,
                                        HEAD_DIM, QK_NORM, UNIT_OFFSET, dtype)
    block_table_ptr = block_tables_ptr + seq64 * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Every key in [begin, end) is visible (the window start was applied above); only the tail of
    # the last tile is masked. With FUSE_STORE the new token (position seq_len - 1) is not in the
    # cache yet: the loop stops before it and the split that owns it takes it from k/v directly.
    if FUSE_STORE:
        cache_end = tl.minimum(end, seq_len - 1)
    else:
        cache_end = end
    for start_n in range(begin, cache_end, BLOCK_N):
        n = start_n + offs_n
        n_valid = n < cache_end
        k, v = load_kv_tile(
            k_ptr, v_ptr, block_table_ptr, n, n_valid, kv_head,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, offs_d, d_mask,
            PAGE_SIZE=PAGE_SIZE, PAGED=True, MASKED=True, EVEN_D=EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = log2_scores(s, scale, softcap, SOFTCAP=SOFTCAP)
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds >= 1 valid key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the cache is read: the next kernel may be scheduled

    if FUSE_STORE:
        k_new_row = k_new_ptr + seq64 * stride_knt + kv_head * stride_knh + offs_d
        v_new_row = v_new_ptr + seq64 * stride_vnt + kv_head * stride_vnh + offs_d
        newest = seq_len - 1
        if (newest >= begin) & (newest < end):
            if ROPE:
                k_new = tl.sum(k_rotated.to(tl.float32), axis=0)  # the one row, as a vector
            else:
                k_new = tl.load(k_new_row, mask=d_mask, other=0.0).to(tl.float32)
            v_new = tl.load(v_new_row, mask=d_mask, other=0.0).to(tl.float32)
            s_new = log2_scores(tl.sum(q.to(tl.float32) * k_new[None, :], 1), scale, softcap, SOFTCAP=SOFTCAP)
            m_new = tl.maximum(m_i, s_new)
            p_new = tl.exp2(s_new - m_new)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :]
            m_i = m_new
        # One program per (sequence, kv head) writes the new K/V; no program of this launch reads
        # that slot, so there is no race. Padding rows (seq >= num_stores) write nothing.
        if (split == 0) & (seq < num_stores):
            slot = tl.load(slot_ptr + seq).to(tl.int64)
            if slot >= 0:
                dst = (slot // PAGE_SIZE) * stride_kb + (slot % PAGE_SIZE) * stride_ko + kv_head * stride_kh
                dst_v = (slot // PAGE_SIZE) * stride_vb + (slot % PAGE_SIZE) * stride_vo + kv_head * stride_vh
                if ROPE:
                    tl.store(k_ptr + dst + offs_d[None, :], k_rotated.to(k_ptr.dtype.element_ty),
                             mask=d_mask[None, :])
                else:
                    tl.store(k_ptr + dst + offs_d, tl.load(k_new_row, mask=d_mask).to(k_ptr.dtype.element_ty),
                             mask=d_mask)
                tl.store(v_ptr + dst_v + offs_d, tl.load(v_new_row, mask=d_mask).to(v_ptr.dtype.element_ty),
                         mask=d_mask)

    o_ptrs = out_ptr + seq64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 (a padding sequence): write zeros
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        if active == 1:
            if split == 0:
                l_safe = tl.where(l_i > 0.0, l_i, 1.0)
                tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=qo_mask)
        elif split < active:
            # partials are [num_seqs, NUM_HEADS, num_splits(, BLOCK_D)] fp32
            rows = (seq64 * NUM_HEADS + heads) * num_splits
            g_mask = offs_g < GROUP
            tl.store(part_max_ptr + rows + split, m_i, mask=g_mask)
            tl.store(part_sum_ptr + rows + split, l_i, mask=g_mask)
            tl.store(part_acc_ptr + (rows + split)[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
            # Every thread's partial stores complete before the one arrival (acq_rel: released to
            # the last arriver, whose loads below then see them; .cg reads L2, never a stale L1).
            tl.debug_barrier()
            counter = arrivals_ptr + seq * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == active - 1:
                # Four splits per iteration, their loads issued together: the merge is a chain of
                # cdiv(active, 4) L2 round trips, not `active` (2.7 us of a llama-3.2-3b layer's 9 us at
                # batch 1). Element-wise over [BLOCK_G, BLOCK_D]: no cross-thread reduction.
                m_run = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
                l_run = tl.zeros([BLOCK_G], dtype=tl.float32)
                acc_run = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
                for s in range(0, active, 4):
                    m0, l0, a0 = _load_partial(part_max_ptr, part_sum_ptr, part_acc_ptr, rows, s, active, g_mask,
                                               offs_d, BLOCK_D)
                    m1, l1, a1 = _load_partial(part_max_ptr, part_sum_ptr, part_acc_ptr, rows, s + 1, active, g_mask,
                                               offs_d, BLOCK_D)
                    m2, l2, a2 = _load_partial(part_max_ptr, part_sum_ptr, part_acc_ptr, rows, s + 2, active, g_mask,
                                               offs_d, BLOCK_D)
                    m3, l3, a3 = _load_partial(part_max_ptr, part_sum_ptr, part_acc_ptr, rows, s + 3, active, g_mask,
                                               offs_d, BLOCK_D)
                    m_new = tl.maximum(tl.maximum(m_run, tl.maximum(m0, m1)), tl.maximum(m2, m3))
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty or absent splits weigh 0
                    alpha = tl.exp2(m_run - m_ref)
                    b0, b1 = tl.exp2(m0 - m_ref), tl.exp2(m1 - m_ref)
                    b2, b3 = tl.exp2(m2 - m_ref), tl.exp2(m3 - m_ref)
                    l_run = l_run * alpha + (l0 * b0 + l1 * b1) + (l2 * b2 + l3 * b3)
                    acc_run = (acc_run * alpha[:, None] + (a0 * b0[:, None] + a1 * b1[:, None])
                               + (a2 * b2[:, None] + a3 * b3[:, None]))
                    m_run = m_new
                o = acc_run / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qo_mask)
                tl.atomic_xchg(counter, 0)  # every active split has arrived: ready for the next launch


MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 128
ONE_TILE_SPLITS = 32  # splits of a single tile (fewer than 64 keys) are allowed up to this count
# One bounded scratch per device (custom_ops.workspace): split partials, and the arrival counters.
_workspaces: dict[torch.device, Workspace] = {}
_arrivals: dict[torch.device, Workspace] = {}


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      block_n: int = MIN_TOKENS_PER_SPLIT) -> int:
    """Splits per (sequence, kv head) so the grid holds ~2 waves of programs, each >= 64 keys, or one
    tile of `block_n` keys where that is still at most ONE_TILE_SPLITS splits.

    Depends only on host ints, so a graph captured for a batch size keeps a valid grid. Batch 1 at
    8k context with 8 kv heads: 33 splits (of 4 tiles each, so 32 busy), ~256 programs on 132 SMs;
    one kv head (Gemma 3 1B/270M) at 4k: 64 splits of 64 keys. A split's tiles are a chain of
    dependent loads, the merge one L2 round trip per four splits: with head dim 256 (32-key tiles)
    and a short visible length, one tile a split is faster (gemma-3-1b's batch-1 step at context 576,
    512-key window: 1.2376 -> 1.2054 ms on an H100, bench/results/h100-2026-11-26/decode-attention-probe/).
    """
    programs = num_seqs * num_kv_heads
    wanted = cdiv(2 * num_sms, programs)
    length = max(max_seq_len, 1)
    one_tile = cdiv(length, block_n)
    by_length = max(cdiv(length, MIN_TOKENS_PER_SPLIT), one_tile if one_tile <= ONE_TILE_SPLITS else 0)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def decode_config(head_dim: int) -> dict:
    """Keys per tile (swept on an H100: 32..128 keys and 4/8 warps within 5% at batch 1 and 32)."""
    if interpreting():
        return dict(BLOCK_N=16, num_warps=1, num_stages=1)
    if head_dim <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def _partials(device: torch.device, num_seqs: int, num_heads: int, num_kv_heads: int, num_splits: int,
              block_d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(acc [rows, block_d], max [rows], sum [rows]) for the split partials: views of the device's
    one workspace (custom_ops.workspace)."""
    rows = num_seqs * num_heads * num_splits
    group = num_heads // num_kv_heads
    bound_rows = 4 * sm_count(device) * group if device.type == "cuda" else rows  # CPU: the interpreter
    workspace = _workspaces.setdefault(device, Workspace())
    flat = workspace.take(rows * (block_d + 2), bound_rows * (block_d + 2), device)
    return (flat[:rows * block_d].view(rows, block_d), flat[rows * block_d:rows * (block_d + 1)],
            flat[rows * (block_d + 1):])


def _arrival_counters(device: torch.device, num_seqs: int, num_kv_heads: int) -> torch.Tensor:
    """int32 [num_seqs * num_kv_heads], all 0: how many splits of each (sequence, kv head) have
    written their partials in the running launch (its last split resets it to 0)."""
    programs = num_seqs * num_kv_heads
    bound = 4 * sm_count(device) if device.type == "cuda" else programs  # splits > 1 only below 2 * SMs
    counters = _arrivals.setdefault(device, Workspace(torch.int32, zeroed=True))
    return counters.take(programs, bound, device)


def launch_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
    sliding_window: int | None, logit_softcap: float | None,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
    num_splits: int | None = None, config: dict | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
    rotary: QKRotary | None = None,
) -> None:
    """Decode attention for ``num_seqs = seq_lens.shape[0]`` sequences; query row i is sequence i.

    ``new_kv = (k, v, slot_mapping, num_tokens)`` fuses the store: row i's key/value (sequence i's
    newest token, not yet in the cache) is attended from ``k, v`` and written to its slot by the
    same launch. Without it the cache must already hold every key.

    ``rotary``: q and new_kv's k are raw (before the q/k norm and the rotary); this launch applies
    them (the stored key is the rotated one). Needs ``new_kv``; cos / sin row i is sequence i's.
    """
    num_seqs = int(seq_lens.shape[0])
    if num_seqs == 0:
        return
    cfg = dict(decode_config(head_dim))
    cfg.update(config or {})
    block_n = cfg.pop("BLOCK_N")
    group = num_heads // num_kv_heads
    block_d = next_power_of_2(head_dim)
    visible = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    if num_splits is None:
        num_splits = 1 if interpreting() else decode_num_splits(
            num_seqs, num_kv_heads, visible, sm_count(q.device), block_n)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if num_splits > 1:
        part_acc, part_max, part_sum = _partials(q.device, num_seqs, num_heads, num_kv_heads, num_splits, block_d)
        arrivals = _arrival_counters(q.device, num_seqs, num_kv_heads)
    else:
        part_acc = part_max = part_sum = arrivals = out  # unused without SPLIT
    if new_kv is not None:
        k_new, v_new, slots, num_stores = new_kv
    else:
        k_new = v_new = slots = q  # unused under FUSE_STORE=False
        num_stores = 0
    if rotary is not None:
        if new_kv is None:
            raise ValueError("launch_decode: rotary needs new_kv (the raw new key is rotated where it is stored)")
        cos, sin = rotary.rows()
        norm = rotary.q_weight is not None
        q_norm, k_norm = (rotary.q_weight, rotary.k_weight) if norm else (cos, cos)
        rope_args = (cos, sin, q_norm, k_norm, cos.stride(0), sin.stride(0), float(rotary.eps))
        rope_flags = dict(ROPE=True, QK_NORM=norm, UNIT_OFFSET=rotary.unit_offset)
    else:
        rope_args = (q, q, q, q, 0, 0, 0.0)  # unread under ROPE=False
        rope_flags = dict(ROPE=False, QK_NORM=False, UNIT_OFFSET=False)
    pdl = launch_with_pdl(q.device)
    q_strides, out_strides, k_strides, v_strides = q.stride(), out.stride(), k_cache.stride(), v_cache.stride()
    k_new_strides, v_new_strides = k_new.stride(), v_new.stride()
    launch(_decode_kernel, (num_seqs, num_kv_heads, num_splits), (
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_max, part_sum, arrivals, k_new, v_new,
        slots,
        q_strides[0], q_strides[1], out_strides[0], out_strides[1],
        k_strides[0], k_strides[1], k_strides[2],
        v_strides[0], v_strides[1], v_strides[2], block_tables.stride(0),
        k_new_strides[0], k_new_strides[1], v_new_strides[0], v_new_strides[1], min(num_stores, num_seqs), num_splits,
        float(scale), float(logit_softcap or 1.0), int(sliding_window or 0), *rope_args,
    ), dict(
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=kv_cache.shape[2],
        SPLIT=num_splits > 1, SOFTCAP=bool(logit_softcap), WINDOW=bool(sliding_window),
        DOT_PRECISION=dot_precision(q.dtype), FUSE_STORE=new_kv is not None, PDL=pdl, **rope_flags,
        **cfg, **pdl_launch_options(pdl),
    ))
