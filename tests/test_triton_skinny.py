"""The skinny GEMM for 2-128 decode rows (custom_ops/triton_skinny.py) against plain torch in float64.

CPU: Triton's interpreter on small ragged shapes (fp32, fp16). GPU (`gpu` mark): the benchmark models'
decode shapes in bf16 at 2, 8, 16 and 64 rows, and a CUDA-graph replay of the down projection on act-and-mul's
output (as the engine runs a gated MLP above one row)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from custom_ops.gemv_table import GemvConfig
from custom_ops.triton_skinny import skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().t()).cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("m", [2, 7, 16, 23, 64])  # 2, 7: x padded to 16 rows; 23: a masked tail of the 32-row tile
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("block_n", [16, 64])  # x on the MMA's left side / the weight on it
def test_skinny_matches_torch_for_ragged_shapes(m, split_k, block_n):
    n, k = 37 + block_n, 83  # neither a multiple of the tiles: masked weight rows and a ragged last K run
    x = torch.randn(m, k, device=DEVICE)
    weight = torch.randn(n, k, device=DEVICE)
    out = skinny_gemm(x, weight, GemvConfig(block_n=block_n, block_k=16, split_k=split_k, num_warps=1))
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, reference(x, weight)) < TOL[torch.float32]


@pytest.mark.parametrize("block_n", [16, 64])
def test_a_split_past_the_last_k_tile_adds_nothing(block_n):
    """Three K tiles over four splits: the last split's first tile, loaded ahead of the PDL wait like
    every split's, lies past K and must count as zeros."""
    x = torch.randn(5, 40, device=DEVICE)
    weight = torch.randn(block_n + 3, 40, device=DEVICE)
    out = skinny_gemm(x, weight, GemvConfig(block_n=block_n, block_k=16, split_k=4, num_warps=1))
    assert rel_err(out, reference(x, weight)) < TOL[torch.float32]


def test_skinny_even_k_split_and_strided_x_in_fp16():
    x = torch.randn(20, 96, device=DEVICE, dtype=torch.float16)[:, :64]  # row stride 96
    weight = torch.randn(48, 64, device=DEVICE, dtype=torch.float16)
    out = torch.full((20, 48), float("nan"), device=DEVICE, dtype=torch.float16)
    for _ in range(2):  # the split's arrival counters must be back at zero for the second launch
        x.normal_()
        assert skinny_gemm(x, weight, GemvConfig(block_n=16, block_k=16, split_k=2, num_warps=1), out=out) is out
        assert rel_err(out, reference(x, weight)) < TOL[torch.float16]


def test_skinny_refuses_what_it_cannot_serve():
    weight = torch.randn(16, 32)
    cfg = GemvConfig(block_n=16, block_k=16)
    with pytest.raises(ValueError, match="2..128 rows"):
        skinny_gemm(torch.randn(1, 32), weight, cfg)
    with pytest.raises(ValueError, match="2..128 rows"):
        skinny_gemm(torch.randn(129, 32), weight, cfg)
    with pytest.raises(ValueError, match="weight"):
        skinny_gemm(torch.randn(16, 32), torch.randn(16, 33), cfg)
    with pytest.raises(ValueError, match="must match"):
        skinny_gemm(torch.randn(16, 32), weight.double(), cfg)
    with pytest.raises(ValueError, match="MMA tiles"):
        skinny_gemm(torch.randn(16, 32), weight, GemvConfig(block_n=8, block_k=16))
    with pytest.raises(ValueError, match="skinny_gemm out"):
        skinny_gemm(torch.randn(16, 32), weight, cfg, out=torch.empty(16, 15))


def test_the_l2_prefetch_setting_is_a_small_power_of_two_named_when_wrong(monkeypatch):
    from custom_ops import triton_skinny
    for value, tiles in (("0", 0), ("4", 4)):
        monkeypatch.setattr(triton_skinny, "_prefetch_tiles", None)
        monkeypatch.setenv(triton_skinny.PREFETCH_ENV, value)
        assert triton_skinny.prefetch_tiles() == tiles
    monkeypatch.setattr(triton_skinny, "_prefetch_tiles", None)
    monkeypatch.setenv(triton_skinny.PREFETCH_ENV, "3")
    with pytest.raises(ValueError, match="INFER_GRAPHS_SKINNY_PREFETCH='3'"):
        triton_skinny.prefetch_tiles()


# ----------------------------------------------------------------------------------------- GPU

def decode_shapes() -> list[tuple[str, int, int]]:
    from bench.gemm import model_gemm_shapes
    return [(f"{model}.{name}", n, k) for model in ("llama-3.2-3b", "qwen3-4b", "gemma-3-1b")
            for name, n, k in model_gemm_shapes(model) if name != "lm_head"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 8, 16, 64])
@pytest.mark.parametrize("split_k", [1, 4])
def test_skinny_decode_shapes_in_bf16(m, split_k):
    for name, n, k in decode_shapes():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        for cfg in (GemvConfig(block_n=64, block_k=128, split_k=split_k, num_warps=4, num_stages=4),
                    GemvConfig(block_n=128, block_k=64, split_k=split_k, num_warps=8, num_stages=3)):
            out = skinny_gemm(x, weight, cfg)
            assert rel_err(out, reference(x, weight)) < TOL[torch.bfloat16], (name, m, cfg)
            # cuBLAS in bf16 is the engine's alternative: the two agree as closely as either with float64
            assert rel_err(out, F.linear(x, weight).double().cpu()) < TOL[torch.bfloat16], (name, m, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tiles", [1, 4])
def test_skinny_with_the_l2_prefetch_is_the_same_product(tiles, monkeypatch):
    """INFER_GRAPHS_SKINNY_PREFETCH (off by default, for a GPU A/B): the prefetch before the PDL wait
    changes where the weight bytes come from, not the sum: the same bits as without it."""
    from custom_ops import triton_skinny
    x = torch.randn(5, 3072, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(16384 + 40, 3072, device="cuda", dtype=torch.bfloat16) * 3072 ** -0.5  # a ragged N tile
    for cfg in (GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
                GemvConfig(block_n=16, block_k=128, split_k=4, num_warps=4, num_stages=4)):
        monkeypatch.setattr(triton_skinny, "_prefetch_tiles", 0)
        plain = skinny_gemm(x, weight, cfg)
        monkeypatch.setattr(triton_skinny, "_prefetch_tiles", tiles)
        assert torch.equal(skinny_gemm(x, weight, cfg), plain), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_skinny_down_projection_replayed_in_a_cuda_graph():
    from custom_ops.linear import act_and_mul_plain
    from custom_ops.triton_gemv import act_mul
    m, n, k = 64, 3072, 8192  # llama-3.2-3b's down projection at batch 64
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    cfg = GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    skinny_gemm(act_mul(gate_up, "silu"), weight, cfg, out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_gemm(act_mul(gate_up, "silu"), weight, cfg, out=out)
    for _ in range(2):  # fresh inputs each replay: the graph reads them, and the split counters reset
        gate_up.normal_()
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(act_and_mul_plain(gate_up.float(), "silu").to(torch.bfloat16), weight)
        assert rel_err(out, expected) < TOL[torch.bfloat16]
