"""The CUDA implementation of `torch.ops.infer.attention`: Triton kernels behind two entry points.

- `dense_causal_attention(q, k, v, out, layer)`: no forward context, one causal sequence, no cache.
- `paged_attention(q, k, v, out, layer, kv_cache, meta)`: decode (``meta.is_uniform_decode``) or
  prefill/extend attention over the paged cache, each storing the real rows' K/V by slot mapping in
  the same launch (one kernel per layer).

No host syncs and launch grids from python ints only, so both are CUDA-graph capturable; the split
scratch of decode is one bounded workspace per device, sliced per launch (triton_decode). Kernels
live in `triton_kv_store` (the unfused store, `fuse_store=False`), `triton_decode`,
`triton_prefill`; the KV layout is documented in `custom_ops.metadata`.
"""
from __future__ import annotations

import torch

from custom_ops import triton_launch
from custom_ops.layers import AttentionLayer
from custom_ops.metadata import AttentionMetadata
from custom_ops.rope import QKRotary, rotate_qk
from custom_ops.triton_decode import launch_decode
from custom_ops.triton_kv_store import store_kv
from custom_ops.triton_prefill import _prefill_kernel, launch_prefill

# Where a prefill launch of one layer differs from the same step's launch of another layer of the
# same kind, it is in the tensors' addresses only: q, k, v, out and the layer's cache. A plan keeps the
# rest of a launch (grid, strides, the step's metadata tensors, the compiled variant) per step and per
# layer kind, so the other layers' calls bind five tensors and launch. Between two piecewise graphs
# that call is host time the GPU waits for, once per layer; re-deriving the launch (checks, tile
# config, strides, the variant's key over 33 arguments) was most of it.
_MAX_PLANS = 64  # a step makes a plan per (metadata, layer kind); older steps' plans are dropped in bulk
_plans: dict[tuple, "_PrefillPlan"] = {}
_BOUND = (0, 1, 2, 3, 7, 8)  # the arguments a layer binds: q, its cache's keys and values, out, k, v


def clear_plans() -> None:
    """Drop every plan (and the metadata tensors they hold): for an engine that closes."""
    _plans.clear()


class _PrefillPlan:
    __slots__ = ("meta", "entry", "grid", "args")

    def __init__(self, meta: AttentionMetadata, entry, grid: tuple[int, int, int], args: tuple) -> None:
        self.meta, self.entry, self.grid = meta, entry, grid
        # The bound slots hold nothing between calls: a plan must not keep a layer's activations or
        # KV cache alive (the metadata it keeps are small views of the engine's step buffers).
        self.args = [None if i in _BOUND else a for i, a in enumerate(args)]

    def run(self, q, k, v, out, kv_cache) -> None:
        args = self.args.copy()
        args[0], args[1], args[2], args[3], args[7], args[8] = q, kv_cache[0], kv_cache[1], out, k, v
        triton_launch.run_variant(self.entry, self.grid, args)


def _plan_key(q, k, v, out, layer, kv_cache, meta) -> tuple | None:
    """What fixes a prefill launch but the addresses; None where the launch cannot be planned (a
    tensor whose last dimension is strided, or not 16-byte aligned: the variant is specialized on it)."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | kv_cache.data_ptr()) & 15:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or out.stride(-1) != 1:
        return None
    return (id(meta), layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale, layer.sliding_window,
            layer.logit_softcap, q.dtype, kv_cache.dtype, q.shape, q.stride(), k.shape, k.stride(), v.stride(),
            out.stride(), kv_cache.shape, kv_cache.stride())


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: AttentionLayer) -> None:
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if q.shape[1:] != (hq, d) or out.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)} / out {tuple(out.shape)} must be [T, {hq}, {d}] and equal")
    if k.shape[1:] != (hkv, d) or v.shape != k.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T={q.shape[0]}, {hkv}, {d}]")
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q and out need a contiguous last dimension")


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: AttentionLayer,
    *, config: dict | None = None,
) -> None:
    """Causal attention of T tokens at positions 0..T-1 (with the layer's window and softcap) into out."""
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    _check_qkv(q, k, v, out, layer)
    t = q.shape[0]
    launch_prefill(
        q, k, v, out, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
        scale=layer.scale, sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap,
        paged=False, num_seqs=1, max_query_len=t, dense_len=t, config=config)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: AttentionLayer,
    kv_cache: torch.Tensor, meta: AttentionMetadata,
    *, num_splits: int | None = None, config: dict | None = None, fuse_store: bool = True,
    rotary: QKRotary | None = None,
) -> None:
    """Store the step's K/V and attend every sequence over its cached prefix plus its new tokens.

    Decode and prefill kernels both store the new K/V in their own launch (one kernel and one
    host-side launch fewer per layer: the launch between two piecewise graphs is host time the GPU
    waits for). ``fuse_store=False`` runs the separate store kernel first. ``num_splits`` /
    ``config`` override the decode split count and tile shapes (tests, benchmarks).

    With ``rotary`` q and k are raw (custom_ops.rope.QKRotary): a decode step's kernel normalizes and
    rotates them as it reads them; any other step runs the q/k norm + rotary kernel first.
    """
    fuse_store = fuse_store and not meta.store_first
    n = meta.num_actual_tokens
    stored = False
    if rotary is not None and not (meta.is_uniform_decode and fuse_store):
        # a store before the attention (a verify step's, whose rows read each other's keys) rides the
        # rotary's launch: one kernel a layer fewer
        q, k = rotate_qk(q, k, rotary, None if fuse_store else (v, kv_cache, meta.slot_mapping, n))
        rotary, stored = None, not fuse_store
    plan_key = None
    if not meta.is_uniform_decode and fuse_store and config is None and triton_launch.fast_path_open(_prefill_kernel):
        plan_key = _plan_key(q, k, v, out, layer, kv_cache, meta)
        plan = _plans.get(plan_key) if plan_key is not None else None
        if plan is not None and plan.meta is meta:
            plan.run(q, k, v, out, kv_cache)
            return
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    _check_qkv(q, k, v, out, layer)
    new_kv = (k, v, meta.slot_mapping, n) if fuse_store else None
    if not fuse_store and not stored:
        store_kv(k, v, kv_cache, meta.slot_mapping, n)
    common = dict(
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
        scale=layer.scale, sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap,
        config=config)
    # Padding rows read nothing; zeros keep them deterministic (as the reference). The prefill launch
    # writes them itself: between two piecewise graphs a separate fill was one more host launch per layer.
    if meta.is_uniform_decode:
        if meta.real_tokens_on_device:
            raise ValueError("paged_attention: a uniform decode step has its token count on the host "
                             "(AttentionMetadata.real_tokens_on_device is for mixed steps)")
        launch_decode(q, kv_cache, out, block_tables=meta.block_tables, seq_lens=meta.seq_lens,
                      max_seq_len=meta.max_seq_len, num_splits=num_splits, new_kv=new_kv, rotary=rotary,
                      **common)
        if n < out.shape[0]:
            out[n:].zero_()
    else:
        launched = launch_prefill(
            q, kv_cache[0], kv_cache[1], out, paged=True, num_seqs=meta.num_seqs, max_query_len=meta.max_query_len,
            block_tables=meta.block_tables, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
            page_size=kv_cache.shape[2], new_kv=new_kv,
            zero_from=None if meta.real_tokens_on_device or n >= out.shape[0] else n,
            zero_tail_on_device=meta.real_tokens_on_device, **common)
        if plan_key is not None and launched is not None:
            grid, args, options = launched
            entry = triton_launch.variant(_prefill_kernel, args, options)
            if entry is not None:
                if len(_plans) >= _MAX_PLANS:
                    _plans.clear()
                _plans[plan_key] = _PrefillPlan(meta, entry, grid, args)
