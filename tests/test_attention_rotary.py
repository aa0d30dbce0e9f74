"""The q/k norm + rotary deferred to the attention op (Qwen3, Gemma 3): in decode steps outside
piecewise replays the rotary op writes nothing and the decode kernel normalizes and rotates the raw
q / k rows it reads; everywhere else the rotary op does the work, as before. Checked against plain
torch in float64 (norm, then transformers' rotate_half rotary, then the attention reference), and
against the two-kernel path the models ran before.

CPU: the kernels in Triton's interpreter on tiny shapes, and the op's CPU implementation. GPU
(`gpu` mark): the benchmark models' head layouts in bf16, eager and in a CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

import custom_ops
from custom_ops import AttentionLayer, RuntimeMode, reference, register_attention_layer, run_attention
from custom_ops.rope import QKRotary, rotary_deferred, rotate_qk
from tests.test_triton_attention import DEVICE, _fused_views, check_close, make_batch, reference_paged, run_paged

EPS = 1e-6


def make_layer(hq, hkv, d, window=None, softcap=None, unit_offset=False) -> AttentionLayer:
    return AttentionLayer(hq, hkv, d, d ** -0.5, window, softcap, qk_norm_eps=EPS, qk_norm_unit_offset=unit_offset)


def rotary_for(tokens, d, dtype, norm, device=DEVICE) -> QKRotary:
    """cos / sin rows [T, 1, D / 2] at random positions (rounded to dtype, as models gather them) and,
    with `norm`, random q/k norm weights (never the identity)."""
    positions = torch.randint(0, 4096, (tokens,)).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = (t.to(dtype).unsqueeze(1).to(device) for t in (angles.cos(), angles.sin()))
    weights = (None, None) if norm is None else tuple(torch.randn(d, dtype=dtype, device=device) for _ in "qk")
    return QKRotary(cos, sin, *weights, EPS, norm == "unit_offset")


def rotate_float64(x: torch.Tensor, rotary: QKRotary, weight: torch.Tensor | None) -> torch.Tensor:
    """x [T, H, D]: per-head RMSNorm (with a weight), then rotate_half, in float64 (transformers' rule)."""
    from transformers.models.llama.modeling_llama import rotate_half
    x = x.detach().cpu().double()
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        w = weight.detach().cpu().double()
        x = x * (1.0 + w if rotary.unit_offset else w)
    cos = torch.cat([rotary.cos, rotary.cos], dim=-1).cpu().double()
    sin = torch.cat([rotary.sin, rotary.sin], dim=-1).cpu().double()
    return x * cos + rotate_half(x) * sin


def expected(q, k, v, cache, meta, layer, rotary):
    """The float64 reference of raw inputs: rotate q and k, then store and attend."""
    q64 = rotate_float64(q, rotary, rotary.q_weight)
    k64 = rotate_float64(k, rotary, rotary.k_weight)
    return reference_paged(q64, k64.to(cache.dtype), v, cache, meta, layer)


@pytest.fixture
def no_separate_rotary(monkeypatch):
    """Decode must not run the q/k norm + rotary kernel: its entry point fails the test if called."""
    from custom_ops import triton_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the separate q/k norm + rotary ran in a decode step")
    monkeypatch.setattr(triton_attention, "rotate_qk", refuse)


@pytest.mark.parametrize("norm", [None, "llama_order", "unit_offset"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, 4.0)])
def test_decode_kernel_norms_and_rotates_q_and_the_new_key_itself(norm, num_splits, window, softcap,
                                                                  no_separate_rotary):
    layer = make_layer(8, 2, 16, window, softcap, unit_offset=norm == "unit_offset")
    q, k, v, cache, meta = make_batch([0, 15, 44], [1, 1, 1], layer, block_size=8, dtype=torch.float32,
                                      device=DEVICE)
    rotary = rotary_for(q.shape[0], 16, torch.float32, norm)
    ref, ref_cache = expected(q, k, v, cache, meta, layer, rotary)
    qf, kf, vf = _fused_views(q, k, v)  # raw q and k as the models pass them: views of the projection
    out = run_paged(qf, kf, vf, cache, meta, layer, num_splits=num_splits, rotary=rotary)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)
    # the stored key is the rotated one; every other slot is untouched
    torch.testing.assert_close(cache.cpu(), ref_cache.to(cache.dtype), rtol=1e-5, atol=1e-5)


def test_decode_fused_matches_the_two_kernel_path_it_replaces():
    layer = make_layer(4, 1, 32, unit_offset=True)  # Gemma's layout: one kv head, (1 + w) norms
    q, k, v, cache, meta = make_batch([3, 30], [1, 1], layer, block_size=4, dtype=torch.float32, device=DEVICE)
    rotary = rotary_for(q.shape[0], 32, torch.float32, "unit_offset")
    two_kernel_cache = cache.clone()
    rq, rk = rotate_qk(q, k, rotary)
    want = run_paged(rq, rk, v, two_kernel_cache, meta, layer, num_splits=2)
    got = run_paged(q, k, v, cache, meta, layer, num_splits=2, rotary=rotary)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, two_kernel_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse_store", [True, False], ids=["fused-store", "store-kernel"])
def test_prefill_and_unfused_store_rotate_first(fuse_store):
    layer = make_layer(4, 2, 16)
    q, k, v, cache, meta = make_batch([0, 9], [5, 3], layer, block_size=4, dtype=torch.float32, device=DEVICE)
    rotary = rotary_for(q.shape[0], 16, torch.float32, "llama_order")
    ref, ref_cache = expected(q, k, v, cache, meta, layer, rotary)
    out = run_paged(q, k, v, cache, meta, layer, fuse_store=fuse_store, rotary=rotary)
    check_close(out, ref, meta.num_actual_tokens, torch.float32)
    torch.testing.assert_close(cache.cpu(), ref_cache.to(cache.dtype), rtol=1e-5, atol=1e-5)


def test_decode_rotary_needs_the_fused_store():
    from custom_ops.triton_decode import launch_decode
    layer = make_layer(4, 2, 16)
    q, k, v, cache, meta = make_batch([4], [1], layer, block_size=4, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="rotary needs new_kv"):
        launch_decode(q, cache, torch.empty_like(q), num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25,
                      sliding_window=None, logit_softcap=None, block_tables=meta.block_tables,
                      seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len,
                      rotary=rotary_for(1, 16, torch.float32, None))


# ------------------------------------------------------------------ the ops' contract (CPU implementation)


def _register(name: str, unit_offset: bool) -> str:
    register_attention_layer(name, make_layer(4, 2, 16, unit_offset=unit_offset))
    return name


def _model_calls(qkv, name, rotary, cache, meta, mode):
    """What an Attention module with q/k norms runs: the rotary op (deferrable), then the attention op
    with the raw q / k and the tables. Returns (out, the rotary op's q)."""
    tokens = qkv.shape[0]
    with custom_ops.forward_context(meta, mode, kv_caches={name: cache}, num_tokens=tokens):
        q, k = torch.ops.infer.qk_norm_rope(qkv, rotary.cos, rotary.sin, rotary.q_weight, rotary.k_weight, EPS,
                                            rotary.unit_offset, 4, 2, True)
        raw_q, raw_k = qkv[:, :64].view(tokens, 4, 16), qkv[:, 64:96].view(tokens, 2, 16)
        v = qkv[:, 96:].view(tokens, 2, 16)
        out = torch.empty_like(q)
        torch.ops.infer.attention(q, k, v, out, name, raw_q, raw_k, rotary.cos, rotary.sin, rotary.q_weight,
                                  rotary.k_weight)
    return out, q


@pytest.mark.parametrize("norm", [None, "llama_order", "unit_offset"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
@pytest.mark.parametrize("mode", [RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL])
def test_the_rotary_op_defers_exactly_where_the_attention_op_takes_over(norm, decode, mode):
    """Decode steps outside piecewise replays: the rotary op writes nothing, the attention op
    normalizes and rotates the raw q / k (and stores the rotated key). Everywhere else the rotary op
    does it and the attention op reads its q / k. Either way: the float64 reference."""
    from tests.paged_helpers import build_metadata
    name = _register(f"rotary.op.{norm}.{decode}.{mode.name}", norm == "unit_offset")
    cached, new = ([5, 2], [1, 1]) if decode else ([5, 2], [3, 1])
    meta = build_metadata(4, [[1, 2], [3]], cached_lens=cached, new_lens=new)
    assert meta.is_uniform_decode == decode
    tokens = sum(new)
    qkv = torch.randn(tokens, (4 + 2 * 2) * 16)
    rotary = rotary_for(tokens, 16, torch.float32, norm, device="cpu")
    cache = custom_ops.allocate_kv_cache(8, 4, 2, 16, torch.float32, "cpu").normal_()
    ref_cache = cache.clone()

    deferred = decode and mode is not RuntimeMode.PIECEWISE
    with custom_ops.forward_context(meta, mode, kv_caches={name: cache}, num_tokens=tokens):
        assert rotary_deferred() == deferred
    out, q = _model_calls(qkv, name, rotary, cache, meta, mode)

    raw_q, raw_k = qkv[:, :64].view(tokens, 4, 16), qkv[:, 64:96].view(tokens, 2, 16)
    want_q = rotate_float64(raw_q, rotary, rotary.q_weight)
    want_k = rotate_float64(raw_k, rotary, rotary.k_weight)
    if not deferred:
        torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    want, ref_cache = torch.empty(tokens, 4, 16, dtype=torch.float64), ref_cache.double()
    reference.paged_attention(want_q, want_k, qkv[:, 96:].view(tokens, 2, 16).double(), want,
                              make_layer(4, 2, 16), ref_cache, meta)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.double(), ref_cache, rtol=1e-5, atol=1e-5)  # the rotated keys were stored


def test_without_deferral_the_attention_op_reads_the_rotary_ops_output():
    """Outside a deferring step the raw arguments are not read: given a different raw q, the result
    is still the one of q and k."""
    name = _register("rotary.not.deferred", False)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    rotary = rotary_for(3, 16, torch.float32, "llama_order", device="cpu")
    got, want = torch.empty_like(q), torch.empty_like(q)
    torch.ops.infer.attention(q, k, v, got, name, torch.randn_like(q), torch.randn_like(k), rotary.cos, rotary.sin,
                              rotary.q_weight, rotary.k_weight)
    torch.ops.infer.attention(q, k, v, want, name)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_op_registrations_with_the_rotary_arguments_pass_opcheck():
    name = _register("rotary.opcheck", False)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    rotary = rotary_for(3, 16, torch.float32, "llama_order", device="cpu")
    torch.library.opcheck(torch.ops.infer.attention.default,
                          (q, k, v, torch.empty_like(q), name, q.clone(), k.clone(), rotary.cos, rotary.sin,
                           rotary.q_weight, rotary.k_weight))
    qkv = torch.randn(3, 8 * 16)
    torch.library.opcheck(torch.ops.infer.qk_norm_rope.default,
                          (qkv, rotary.cos, rotary.sin, rotary.q_weight, rotary.k_weight, EPS, False, 4, 2, True))


def test_bad_rotary_arguments_name_the_layer_and_the_tensor():
    """Checked where they are read: in a decode step the rotary op deferred."""
    from tests.paged_helpers import build_metadata
    name = _register("rotary.bad", False)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    out = torch.empty_like(q)
    rotary = rotary_for(2, 16, torch.float32, "llama_order", device="cpu")
    meta = build_metadata(4, [[1], [2]], cached_lens=[2, 3], new_lens=[1, 1])
    cache = custom_ops.allocate_kv_cache(4, 4, 2, 16, torch.float32, "cpu")
    with custom_ops.forward_context(meta, kv_caches={name: cache}):
        with pytest.raises(ValueError, match="rotary.bad.*raw_q, raw_k, cos and sin are given together"):
            run_attention(q, k, v, out, name, q, k, rotary.cos, None)
        with pytest.raises(ValueError, match=r"rotary.bad.*k_weight \(8,\) must be \[head_dim 16\]"):
            run_attention(q, k, v, out, name, q, k, rotary.cos, rotary.sin, rotary.q_weight, torch.randn(8))
        wrong = rotary_for(2, 8, torch.float32, None, device="cpu")
        with pytest.raises(ValueError, match="rotary.bad.*head_dim 8, the layer's is 16"):
            run_attention(q, k, v, out, name, q, k, wrong.cos, wrong.sin)


# ------------------------------------------------------------------ GPU: the models' layouts in bf16


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, d, norm, window", [(32, 8, 128, "llama_order", None),  # qwen3-4b
                                                      (4, 1, 256, "unit_offset", 512)])     # gemma-3-1b
@pytest.mark.parametrize("batch", [1, 16])
def test_gpu_model_layouts_decode_eager_and_in_a_graph(hq, hkv, d, norm, window, batch, no_separate_rotary):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.bfloat16
    layer = make_layer(hq, hkv, d, window, unit_offset=norm == "unit_offset")
    prefix = torch.randint(100, 900, (batch,)).tolist()
    q, k, v, cache, meta = make_batch(prefix, [1] * batch, layer, block_size=16, dtype=dtype, device="cuda",
                                      max_seq_len=1024)
    rotary = rotary_for(batch, d, dtype, norm, device="cuda")
    qf, kf, vf = _fused_views(q, k, v)
    start = cache.clone()
    ref, ref_cache = expected(q, k, v, start, meta, layer, rotary)
    out = run_paged(qf, kf, vf, cache, meta, layer, rotary=rotary)
    check_close(out, ref, batch, dtype)
    torch.testing.assert_close(cache.cpu().float(), ref_cache.float(), rtol=2e-2, atol=2e-2)

    out = torch.empty_like(q)
    cache.copy_(start)
    from custom_ops import triton_attention
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention.paged_attention(qf, kf, vf, out, layer, cache, meta, rotary=rotary)
    cache.copy_(start)
    fresh = _fused_views(torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    for view, new in zip((qf, kf, vf), fresh):
        view.copy_(new)  # new raw q / k / v at the captured addresses
    graph.replay()
    ref, _ = expected(qf, kf, vf, start, meta, layer, rotary)
    check_close(out, ref, batch, dtype)
