"""The decode GEMV / split-K kernel (custom_ops/triton_gemv.py) against plain torch in float64.

CPU: Triton's interpreter on small shapes (fp32, fp16). GPU (`gpu` mark): the decode shapes of the
benchmark models in bf16, every config the gemm bench sweeps, and a CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from custom_ops.triton_gemv import GemvConfig, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 on the inputs' device (an LM head in float64 is GBs to move), returned on the CPU."""
    return (x.double() @ weight.double().t()).cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-12))


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("m", [1, 3, 8, 17])   # 17: tl.dot tiles of 16 rows and a masked second tile
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_matches_torch_for_ragged_shapes(m, split_k):
    n, k = 37, 83  # neither a multiple of the tiles: masked rows and a ragged last K run
    x = torch.randn(m, k, device=DEVICE)
    weight = torch.randn(n, k, device=DEVICE)
    out = gemv(x, weight, GemvConfig(block_n=16, block_k=16, split_k=split_k, num_warps=1))
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, reference(x, weight)) < TOL[torch.float32]


def test_gemv_split_k_leaves_its_counters_at_zero_and_runs_again():
    from custom_ops import triton_gemv
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    weight = torch.randn(40, 64, device=DEVICE, dtype=torch.float16)
    out = torch.full((2, 40), float("nan"), device=DEVICE, dtype=torch.float16)
    for _ in range(2):  # fresh inputs each time: a stale counter would skip or repeat the merge
        x = torch.randn(2, 64, device=DEVICE, dtype=torch.float16)
        assert gemv(x, weight, GemvConfig(block_n=16, block_k=16, split_k=4, num_warps=1), out=out) is out
        assert rel_err(out, reference(x, weight)) < TOL[torch.float16]
        assert not triton_gemv._arrivals[device].buffer.any()


def test_gemv_more_splits_than_k_tiles_and_a_strided_x():
    x = torch.randn(4, 48, device=DEVICE)[:, :32]  # row stride 48
    weight = torch.randn(20, 32, device=DEVICE)
    out = gemv(x, weight, GemvConfig(block_n=16, block_k=16, split_k=5, num_warps=1))  # 3 splits get no K
    assert rel_err(out, reference(x, weight)) < TOL[torch.float32]


def test_gemv_refuses_bad_shapes_and_configs():
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        gemv(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="must match"):
        gemv(x, weight.double())
    with pytest.raises(ValueError, match="gemv out"):
        gemv(x, weight, out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=24)
    with pytest.raises(ValueError, match="split_k"):
        GemvConfig(split_k=0)
    with pytest.raises(ValueError, match="tl.dot"):
        gemv(torch.randn(16, 8), weight, GemvConfig(block_n=8))


# ----------------------------------------------------------------------------------------- GPU

def decode_shapes() -> list[tuple[str, int, int]]:
    from bench.gemm import model_gemm_shapes
    return [(f"{model}.{name}", n, k) for model in ("llama-3.2-3b", "qwen3-4b", "gemma-3-1b")
            for name, n, k in model_gemm_shapes(model)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_gemv_decode_shapes_match_float64_in_bf16(m):
    from bench.gemm import CONFIGS
    failures = []
    for label, n, k in decode_shapes():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        ref = reference(x, weight)
        for cfg in CONFIGS:
            if m >= 16 and cfg.block_n < 16:
                continue
            err = rel_err(gemv(x, weight, cfg), ref)
            if not err < TOL[torch.bfloat16]:
                failures.append(f"{label} m={m} {cfg.label()}: rel err {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_gpu_gemv_split_k_replays_in_a_cuda_graph_with_new_inputs():
    x = torch.randn(8, 3072, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3072, 3072, device="cuda", dtype=torch.bfloat16) * 3072 ** -0.5
    out = torch.empty(8, 3072, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(block_n=32, block_k=256, split_k=4)
    gemv(x, weight, cfg, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, weight, cfg, out=out)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(x, weight)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("capability, env, expected", [
    ((9, 0), None, True), ((10, 0), "1", True), ((8, 0), None, False), ((9, 0), "0", False)])
def test_kernels_use_pdl_on_hopper_and_newer_unless_turned_off(monkeypatch, capability, env, expected):
    """Programmatic dependent launch needs sm_90's griddepcontrol; INFER_GRAPHS_PDL=0 rules it out. The
    decision is made at a device's first launch and kept (no environment read per launch)."""
    from custom_ops import pdl
    monkeypatch.setattr(pdl, "_by_device", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if env is None:
        monkeypatch.delenv("INFER_GRAPHS_PDL", raising=False)
    else:
        monkeypatch.setenv("INFER_GRAPHS_PDL", env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    cuda0 = torch.device("cuda", 0)
    assert pdl.launch_with_pdl(cuda0) is expected
    assert pdl.pdl_launch_options(expected) == ({"launch_pdl": True} if expected else {})
    monkeypatch.setenv("INFER_GRAPHS_PDL", "1" if env == "0" else "0")
    assert pdl.launch_with_pdl(cuda0) is expected  # kept
    assert pdl.launch_with_pdl(torch.device("cpu")) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pdl, "_by_device", {})
    assert pdl.launch_with_pdl(cuda0) is False  # the interpreter runs no griddepcontrol
