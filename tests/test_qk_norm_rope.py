"""The q/k norm + rotary op (custom_ops/rope.py, custom_ops/triton_rope.py) against plain torch in
float64, and against transformers' own rotary.

CPU: the Triton kernel in Triton's interpreter on small shapes (with and without the per-head norms,
both norm variants), the op's registration (opcheck). GPU (`gpu` mark): the benchmark models' head
layouts in bf16, eager and in a CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

import custom_ops  # noqa: F401  (registers torch.ops.infer.qk_norm_rope)
from custom_ops import run_qk_norm_rope
from custom_ops.triton_rope import qk_norm_rope_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def tables(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin rows [tokens, 1, head_dim / 2] at random positions, rounded to dtype as models gather them."""
    positions = torch.randint(0, 4096, (tokens,)).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    return (angles.cos().to(dtype).unsqueeze(1).to(DEVICE), angles.sin().to(dtype).unsqueeze(1).to(DEVICE))


def reference(qkv, cos, sin, q_weight, k_weight, unit_offset, hq, hkv):
    """float64: per-head RMSNorm (if weights), then rotate_half rotary, as transformers computes it."""
    from transformers.models.llama.modeling_llama import rotate_half
    tokens, d = qkv.shape[0], 2 * cos.shape[-1]
    x = qkv[:, :(hq + hkv) * d].double().reshape(tokens, hq + hkv, d)
    if q_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        w = torch.cat([q_weight.double().expand(hq, -1), k_weight.double().expand(hkv, -1)])
        x = x * (1.0 + w if unit_offset else w)
    full_cos = torch.cat([cos, cos], dim=-1).double()  # HF's tables repeat the half
    full_sin = torch.cat([sin, sin], dim=-1).double()
    rotated = x * full_cos + rotate_half(x) * full_sin
    return rotated[:, :hq], rotated[:, hq:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.to(a.device)).norm() / b.norm().clamp_min(1e-12))


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("norm", [None, "llama_order", "unit_offset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hq, hkv, d", [(1, 4, 2, 16), (5, 3, 1, 8), (2, 6, 2, 32)])
def test_kernel_matches_float64_reference(tokens, hq, hkv, d, dtype, norm):
    extra = 7  # v and a ragged tail after q and k: the kernel reads only q's and k's columns
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d + extra, device=DEVICE, dtype=dtype)
    cos, sin = tables(tokens, d, dtype)
    q_weight = k_weight = None
    if norm is not None:
        q_weight = torch.randn(d, device=DEVICE, dtype=dtype)
        k_weight = torch.randn(d, device=DEVICE, dtype=dtype)
    unit_offset = norm == "unit_offset"
    q_in = qkv[:, :hq * d].view(tokens, hq, d)  # views of the fused projection, as models pass them
    k_in = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    q, k = qk_norm_rope_triton(q_in, k_in, cos.reshape(tokens, -1), sin.reshape(tokens, -1), q_weight, k_weight,
                               EPS, unit_offset)
    want_q, want_k = reference(qkv, cos, sin, q_weight, k_weight, unit_offset, hq, hkv)
    assert q.shape == (tokens, hq, d) and k.shape == (tokens, hkv, d) and q.dtype == dtype
    assert rel_err(q, want_q) < TOL[dtype] and rel_err(k, want_k) < TOL[dtype]


@pytest.mark.parametrize("norm", [None, "unit_offset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hq, hkv, d, num_store", [(5, 4, 2, 16, 5), (8, 3, 1, 8, 6), (2, 6, 2, 32, 2)])
def test_kernel_stores_the_rotated_k_and_v_as_the_store_kernel_would(tokens, hq, hkv, d, num_store, dtype, norm):
    """With `store` the launch also writes the rotated k and v of the first num_store tokens into the paged
    cache at their slots (a negative slot: none), exactly what rotating and then store_kv write; the
    rest of the cache is untouched, and q / k are those of the launch without it."""
    from custom_ops.triton_kv_store import store_kv
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype)
    cos, sin = tables(tokens, d, dtype)
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    q_weight = k_weight = None
    if norm is not None:
        q_weight, k_weight = torch.randn(d, device=DEVICE, dtype=dtype), torch.randn(d, device=DEVICE, dtype=dtype)
    q_in = qkv[:, :hq * d].view(tokens, hq, d)
    k_in = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    block_size, blocks = 4, 6
    slots = torch.randperm(blocks * block_size, device=DEVICE)[:tokens]
    slots[tokens // 2] = -1  # no slot: nothing written for that token
    noise = torch.randn(2, blocks, block_size, hkv, d, device=DEVICE, dtype=dtype)
    cache, want_cache = noise.clone(), noise.clone()
    q, k = qk_norm_rope_triton(q_in, k_in, cos, sin, q_weight, k_weight, EPS, norm == "unit_offset",
                               store=(v, cache, slots, num_store))
    want_q, want_k = qk_norm_rope_triton(q_in, k_in, cos, sin, q_weight, k_weight, EPS, norm == "unit_offset")
    store_kv(want_k, v, want_cache, slots, num_store)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(cache, want_cache)
    assert not torch.equal(cache, noise)  # something was stored
    with pytest.raises(ValueError, match="qk_norm_rope_triton store"):
        qk_norm_rope_triton(q_in, k_in, cos, sin, q_weight, k_weight, EPS, False, store=(v, cache[0], slots, 1))


def test_cpu_op_is_the_unfused_model_code_and_matches_float64():
    tokens, hq, hkv, d = 3, 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    cos, sin = tables(tokens, d, torch.float32)
    q_weight, k_weight = torch.randn(d), torch.randn(d)
    q, k = torch.ops.infer.qk_norm_rope(qkv, cos.cpu(), sin.cpu(), q_weight, k_weight, EPS, False, hq, hkv)
    want_q, want_k = reference(qkv, cos.cpu(), sin.cpu(), q_weight, k_weight, False, hq, hkv)
    assert rel_err(q, want_q) < TOL[torch.float32] and rel_err(k, want_k) < TOL[torch.float32]
    assert q.is_contiguous() and k.is_contiguous()


def test_op_registration_and_fake_pass_opcheck():
    tokens, hq, hkv, d = 3, 2, 1, 8
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    cos, sin = (t.cpu() for t in tables(tokens, d, torch.float32))
    torch.library.opcheck(torch.ops.infer.qk_norm_rope.default, (qkv, cos, sin, None, None, 0.0, False, hq, hkv))
    torch.library.opcheck(torch.ops.infer.qk_norm_rope.default,
                          (qkv, cos, sin, torch.randn(d), torch.randn(d), EPS, True, hq, hkv))


def test_bad_inputs_name_the_tensor_and_its_shape():
    qkv = torch.randn(2, 32)
    cos = sin = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match=r"qkv \(2, 32\) must be"):
        run_qk_norm_rope(qkv, cos, sin, None, None, EPS, False, 4, 2)  # 6 heads of 8 need 48 columns
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        run_qk_norm_rope(qkv, cos, sin, torch.randn(8), None, EPS, False, 2, 1)
    with pytest.raises(ValueError, match=r"k_weight \(4,\) must be \[head_dim 8\]"):
        run_qk_norm_rope(qkv, cos, sin, torch.randn(8), torch.randn(4), EPS, False, 2, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, d, norm", [(24, 8, 128, None), (32, 8, 128, "llama_order"),
                                              (4, 1, 256, "unit_offset")])  # llama-3.2-3b, qwen3-4b, gemma-3-1b
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_bf16_model_layouts_match_reference_eager_and_in_a_graph(tokens, hq, hkv, d, norm):
    dtype = torch.bfloat16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    cos, sin = tables(tokens, d, dtype)
    q_weight = k_weight = None
    if norm is not None:
        q_weight, k_weight = torch.randn(d, device="cuda", dtype=dtype), torch.randn(d, device="cuda", dtype=dtype)
    unit_offset = norm == "unit_offset"
    args = (q_weight, k_weight, EPS, unit_offset, hq, hkv)
    q, k = run_qk_norm_rope(qkv, cos, sin, *args)
    want_q, want_k = reference(qkv, cos, sin, q_weight, k_weight, unit_offset, hq, hkv)
    assert rel_err(q, want_q) < TOL[dtype] and rel_err(k, want_k) < TOL[dtype]

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_q, g_k = run_qk_norm_rope(qkv, cos, sin, *args)
    qkv.copy_(torch.randn_like(qkv))  # fresh inputs at the captured addresses
    graph.replay()
    want_q, want_k = reference(qkv, cos, sin, q_weight, k_weight, unit_offset, hq, hkv)
    assert rel_err(g_q, want_q) < TOL[dtype] and rel_err(g_k, want_k) < TOL[dtype]
