"""The residual add + RMSNorm op (custom_ops/norm.py, custom_ops/triton_rms_norm.py) against plain
torch in float64 (the models' use of it: tests/test_models_compile.py).

CPU: the Triton kernel in Triton's interpreter on small ragged shapes, and the op's registration
(opcheck). GPU (`gpu` mark): the benchmark models' hidden
sizes in bf16, in eager and in a CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

import custom_ops  # noqa: F401  (registers torch.ops.infer.add_rms_norm)
from custom_ops import run_add_rms_norm
from custom_ops.triton_rms_norm import add_rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def norm64(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (
        1.0 + weight.double() if unit_offset else weight.double())


def reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, unit_offset: bool,
              delta_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 from the sum rounded to h's dtype (the contract: the norm reads the rounded sum; a
    branch norm's output is rounded before the add)."""
    if delta_weight is not None:
        delta = norm64(delta, delta_weight, unit_offset).to(h.dtype)
    total = (h.double() + delta.double()).to(h.dtype)
    return total, norm64(total, weight, unit_offset)


def assert_sum_rounded_once(total: torch.Tensor, want: torch.Tensor) -> None:
    """The compiled kernel rounds the exact float32 sum to nearest: bit-equal. Triton's interpreter
    converts float32 to bf16 by truncation, one unit in the last place off at most."""
    if DEVICE == "cuda" or total.dtype == torch.float32:
        assert torch.equal(total, want)
    else:
        ulp = want.double().abs() * 2.0 ** -7
        assert ((total.double() - want.double()).abs() <= ulp).all()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.to(a.device)).norm() / b.norm().clamp_min(1e-12))


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 40), (5, 100), (3, 64)])  # ragged and power-of-two rows
def test_kernel_matches_float64_reference(rows, hidden, dtype, unit_offset):
    h = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    delta = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    weight = torch.randn(hidden, device=DEVICE, dtype=dtype)
    total, normed = add_rms_norm_triton(h, delta, weight, EPS, unit_offset)
    want_total, want_normed = reference(h, delta, weight, unit_offset)
    assert_sum_rounded_once(total, want_total)
    assert normed.dtype == dtype and rel_err(normed, want_normed) < TOL[dtype]


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_a_branch_norm_matches_float64_reference(dtype, unit_offset):
    h = torch.randn(3, 72, device=DEVICE, dtype=dtype)
    delta = 5 * torch.randn(3, 72, device=DEVICE, dtype=dtype)  # the branch norm must rescale it
    weight, delta_weight = (torch.randn(72, device=DEVICE, dtype=dtype) for _ in range(2))
    total, normed = add_rms_norm_triton(h, delta, weight, EPS, unit_offset, delta_weight)
    want_total, want_normed = reference(h, delta, weight, unit_offset, delta_weight)
    assert rel_err(total, want_total.double()) < TOL[dtype] and rel_err(normed, want_normed) < TOL[dtype]


def test_kernel_reads_strided_rows_and_writes_fresh_tensors():
    wide = torch.randn(4, 96, device=DEVICE)
    h, delta = wide[:, :48], wide[:, 48:]  # row stride 96, as a slice of a fused projection is
    weight = torch.randn(48, device=DEVICE)
    total, normed = add_rms_norm_triton(h, delta, weight, EPS, False)
    want_total, want_normed = reference(h, delta, weight, False)
    assert torch.equal(total, want_total) and rel_err(normed, want_normed) < TOL[torch.float32]
    assert total.is_contiguous() and normed.is_contiguous()
    assert total.data_ptr() not in (h.data_ptr(), delta.data_ptr())


def test_op_registration_and_fake_pass_opcheck():
    h, delta, weight = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.infer.add_rms_norm.default, (h, delta, weight, EPS, False))
    torch.library.opcheck(torch.ops.infer.add_rms_norm.default, (h, delta, weight, EPS, True))
    torch.library.opcheck(torch.ops.infer.add_rms_norm.default, (h, delta, weight, EPS, True, torch.randn(16)))


def test_op_equals_the_unfused_model_code_on_the_cpu():
    from custom_ops import rms_norm
    h, delta = torch.randn(6, 32, dtype=torch.bfloat16), torch.randn(6, 32, dtype=torch.bfloat16)
    weight = torch.randn(32, dtype=torch.bfloat16)
    delta_weight = torch.randn(32, dtype=torch.bfloat16)
    for unit_offset in (False, True):
        total, normed = torch.ops.infer.add_rms_norm(h, delta, weight, EPS, unit_offset)
        assert torch.equal(total, h + delta)
        assert torch.equal(normed, rms_norm(h + delta, weight, EPS, unit_offset))
        total, normed = torch.ops.infer.add_rms_norm(h, delta, weight, EPS, unit_offset, delta_weight)
        want = h + rms_norm(delta, delta_weight, EPS, unit_offset)
        assert torch.equal(total, want) and torch.equal(normed, rms_norm(want, weight, EPS, unit_offset))


def test_bad_inputs_name_the_tensor_and_its_shape():
    h = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"delta \(2, 9\)"):
        run_add_rms_norm(h, torch.randn(2, 9), torch.randn(8), EPS, False)
    with pytest.raises(ValueError, match=r"weight \(7,\) must be \[hidden\]"):
        run_add_rms_norm(h, torch.randn(2, 8), torch.randn(7), EPS, False)
    with pytest.raises(ValueError, match=r"delta_weight \(9,\) must be \[hidden\]"):
        run_add_rms_norm(h, torch.randn(2, 8), torch.randn(8), EPS, False, torch.randn(9))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [3072, 2560, 1152])  # llama-3.2-3b, qwen3-4b, gemma-3-1b
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_bf16_model_sizes_match_reference_eager_and_in_a_graph(rows, hidden):
    torch.manual_seed(rows + hidden)
    for unit_offset, branch_norm in ((False, False), (True, False), (True, True)):  # gemma: branch norms
        h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        delta = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        delta_weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16) if branch_norm else None
        want_total, want_normed = reference(h, delta, weight, unit_offset, delta_weight)
        total, normed = run_add_rms_norm(h, delta, weight, EPS, unit_offset, delta_weight)
        assert_sum(total, want_total, branch_norm)
        assert rel_err(normed, want_normed) < TOL[torch.bfloat16]

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_total, g_normed = run_add_rms_norm(h, delta, weight, EPS, unit_offset, delta_weight)
        h.copy_(torch.randn_like(h))  # fresh inputs at the captured addresses
        delta.copy_(torch.randn_like(delta))
        graph.replay()
        want_total, want_normed = reference(h, delta, weight, unit_offset, delta_weight)
        assert_sum(g_total, want_total, branch_norm)
        assert rel_err(g_normed, want_normed) < TOL[torch.bfloat16]


def assert_sum(total: torch.Tensor, want: torch.Tensor, branch_norm: bool) -> None:
    """Without a branch norm the sum is one rounding of an exact sum: bit-equal. With one, the
    branch's norm may round differently from float64 by one unit, and the sum with it."""
    if branch_norm:
        assert rel_err(total, want.double()) < TOL[torch.bfloat16]
    else:
        assert torch.equal(total, want)
