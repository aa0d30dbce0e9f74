"""The q/k/v projection with its rotary (custom_ops/qkv_rope.py, custom_ops/triton_gemv_rope.py)
against plain torch in float64 and against the two ops it fuses.

CPU: the one-launch kernel in Triton's interpreter on small head layouts (ragged v tails, every
tile that fits a head's half), the op's dispatch (one row and a table entry that fits: the kernel;
anything else: linear then rotary), its registration (opcheck), its checks. GPU (`gpu` mark, in
tests/test_decode_gemv_gpu.py): Llama 3.2 3B's projection in bf16, eager and replayed in a graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import custom_ops.linear
import custom_ops.triton_gemv_rope
from custom_ops import GemvConfig, run_linear_rope, run_qk_norm_rope
from custom_ops.triton_gemv_rope import fits, gemv_rope
from custom_ops.triton_rope import qk_norm_rope_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope_tables(head_dim: int, position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = position * inv_freq
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


def reference(x, weight, cos, sin, hq, hkv):
    """float64: the projection, then rotate_half on its q and k heads (transformers' formula)."""
    from transformers.models.llama.modeling_llama import rotate_half
    d = 2 * cos.shape[-1]
    qkv = x.double() @ weight.double().t()
    heads = qkv[:, :(hq + hkv) * d].reshape(1, hq + hkv, d)
    full_cos, full_sin = torch.cat([cos, cos]).double(), torch.cat([sin, sin]).double()
    rotated = heads * full_cos + rotate_half(heads) * full_sin
    return qkv, rotated[:, :hq], rotated[:, hq:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-12))


# (num_heads, num_kv_heads, head_dim, extra v rows): GQA, MHA, and an N that no tile divides
LAYOUTS = [(4, 2, 16, 0), (2, 2, 8, 0), (3, 1, 16, 5)]


@pytest.mark.parametrize("hq, hkv, d, extra", LAYOUTS)
@pytest.mark.parametrize("block_n", [2, 4, 8, 16])
def test_the_kernel_is_the_projection_and_its_rotary_in_float64(hq, hkv, d, extra, block_n):
    config = GemvConfig(block_n=block_n, block_k=32, num_warps=1)
    if not fits(config, d):
        pytest.skip(f"block_n {block_n} does not tile head_dim {d} / 2 in halves")
    k_dim = 72  # a ragged last K tile
    n = (hq + 2 * hkv) * d + extra
    x, weight = torch.randn(1, k_dim, device=DEVICE), torch.randn(n, k_dim, device=DEVICE)
    cos, sin = rope_tables(d, 37, torch.float32)
    qkv, q, k = gemv_rope(x, weight, cos, sin, config, hq, hkv)
    want_qkv, want_q, want_k = reference(x, weight, cos, sin, hq, hkv)
    assert qkv.shape == (1, n) and q.shape == (1, hq, d) and k.shape == (1, hkv, d)
    assert q.is_contiguous() and k.is_contiguous()
    for got, want in ((qkv, want_qkv), (q, want_q), (k, want_k)):
        assert rel_err(got.cpu(), want.cpu()) < 1e-5


def test_in_fp16_it_rounds_as_the_projection_then_the_rotary_kernel_do():
    """The kernel rounds the sums to fp16 and rotates those, as the two-kernel path reads the stored
    projection: its q and k are the rotary kernel (what CUDA runs) applied to its own qkv, to the
    last bit."""
    hq, hkv, d = 4, 2, 16
    n, k_dim = (hq + 2 * hkv) * d, 64
    x = torch.randn(1, k_dim, device=DEVICE).half()
    weight = (torch.randn(n, k_dim, device=DEVICE) * k_dim ** -0.5).half()
    cos, sin = rope_tables(d, 1000, torch.float16)
    qkv, q, k = gemv_rope(x, weight, cos, sin, GemvConfig(block_n=4, block_k=32, num_warps=1), hq, hkv)
    q2, k2 = qk_norm_rope_triton(qkv[:, :hq * d].view(1, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(1, hkv, d),
                                 cos[None], sin[None], None, None, 0.0, False)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert rel_err(qkv.cpu(), (x.double() @ weight.double().t()).cpu()) < 2e-3


@pytest.fixture
def launches(monkeypatch):
    """The op on the CPU as on a GPU: the table answers `config` for every shape at one row, and
    each one-launch call is recorded."""
    chosen = GemvConfig(block_n=4, block_k=32, num_warps=1)
    calls = []
    real = custom_ops.triton_gemv_rope.gemv_rope

    def spy(*args):
        calls.append(args[4])
        return real(*args)
    monkeypatch.setattr(custom_ops.linear, "gemv_config",
                        lambda rows, n, k, dtype, device_type, *_: chosen if rows == 1 else None)
    monkeypatch.setattr(custom_ops.triton_gemv_rope, "gemv_rope", spy)
    return calls


def _inputs(tokens: int, bias: bool = False):
    hq, hkv, d, k_dim = 4, 2, 16, 48
    n = (hq + 2 * hkv) * d
    x, weight = torch.randn(tokens, k_dim, device=DEVICE), torch.randn(n, k_dim, device=DEVICE)
    cos, sin = rope_tables(d, 11, torch.float32)
    b = torch.randn(n, device=DEVICE) if bias else None
    return x, weight, b, cos.expand(tokens, -1), sin.expand(tokens, -1), hq, hkv


def _two_ops(x, weight, b, cos, sin, hq, hkv):
    qkv = F.linear(x, weight, b)
    q, k = run_qk_norm_rope(qkv, cos, sin, None, None, 0.0, False, hq, hkv)
    return qkv, q, k


def test_one_row_with_a_fitting_table_entry_is_one_launch(launches):
    args = _inputs(1)
    got = run_linear_rope(*args)
    assert len(launches) == 1
    for a, b in zip(got, _two_ops(*args)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", ["two rows", "bias", "split-K entry", "tile wider than a head's half"])
def test_everything_else_runs_the_projection_then_the_rotary(launches, monkeypatch, case):
    args = _inputs(2 if case == "two rows" else 1, bias=case == "bias")
    if case in ("split-K entry", "tile wider than a head's half"):
        config = (GemvConfig(block_n=4, block_k=32, split_k=2, num_warps=1) if case == "split-K entry"
                  else GemvConfig(block_n=32, block_k=32, num_warps=1))  # 16 rows a half > 8
        monkeypatch.setattr(custom_ops.linear, "gemv_config", lambda *a: config)
    got = run_linear_rope(*args)
    assert launches == []
    for a, b in zip(got, _two_ops(*args)):
        torch.testing.assert_close(a, b)


def test_the_op_passes_opcheck_and_names_bad_shapes():
    x, weight, b, cos, sin, hq, hkv = _inputs(3, bias=True)
    torch.library.opcheck(torch.ops.infer.linear_rope.default, (x, weight, b, cos, sin, hq, hkv))
    with pytest.raises(ValueError, match=r"infer.linear_rope: x \(3, 47\)"):
        run_linear_rope(x[:, :47], weight, b, cos, sin, hq, hkv)
    with pytest.raises(ValueError, match="fewer than"):
        run_linear_rope(x, weight, b, cos, sin, hq + 5, hkv)
    with pytest.raises(ValueError, match=r"infer.linear_rope: cos"):
        run_linear_rope(x, weight, b, cos, sin[:, :3], hq, hkv)
