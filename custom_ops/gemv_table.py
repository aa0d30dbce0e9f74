"""Which decode matmuls run the Triton GEMV (custom_ops.triton_gemv), and with which tiles: measured
data and the one function that reads it. No Triton import here: models consult the table at every
call of `torch.ops.infer.linear`, on machines without Triton too.

Tiles are measured on one GPU and hold for GPUs of its compute capability only: `TABLES` maps a
compute capability to the tables measured there and where they come from. A GPU whose capability has
no table runs every matmul on cuBLAS, and says so once in the log.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("custom_ops")


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name}={value} must be a power of two")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"GemvConfig split_k={self.split_k}, num_stages={self.num_stages} must be >= 1")

    def label(self) -> str:
        """nBLOCK_N kBLOCK_K sSPLIT_K wWARPS, and stSTAGES where the stages are not the default 3."""
        stages = "" if self.num_stages == 3 else f"st{self.num_stages}"
        return f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}{stages}"


# (N, K) -> the GEMV config for one row. First picked by timing each call alone against cuBLAS (the
# "pick" rows at batch 1 of bench/results/h100-2026-11-23/gemm-*.md, `python -m bench gemm`; us per
# call there, GEMV vs cuBLAS's default). Entries marked "in graph" were then re-picked by what they cost
# the whole batch-1 decode graph (`python -m bench gemv_graph`, bench/results/h100x2-2026-11-26/
# gemv-in-graph/): under PDL a tile that is fastest alone can hold up its neighbours, and llama's
# gate_up cost the step ~85 us more with the tile that won alone. Any model whose matmul has one of
# these shapes uses the entry. A shape without an entry uses cuBLAS. Above one row the GEMV lost (2-3x
# slower than cuBLAS at batch 8); 2-64 rows: SKINNY_CONFIGS below. fp16 streams the same bytes through
# the same tiles as bf16 and shares the entries.
GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (5120, 3072): GemvConfig(block_n=4, block_k=512, split_k=1, num_warps=4),    # llama-3.2-3b qkv: in graph -2.7 us
    (3072, 3072): GemvConfig(block_n=4, block_k=512, split_k=1, num_warps=4),    # o: in graph -3.4 us
    (16384, 3072): GemvConfig(block_n=2, block_k=4096, split_k=1, num_warps=4),  # gate_up: in graph -85 us, whole K -35
    (3072, 8192): GemvConfig(block_n=8, block_k=1024, split_k=1, num_warps=8),   # down: in graph -7.1 us, 8 warps -6.5
    (128256, 3072): GemvConfig(block_n=2, block_k=4096, split_k=1, num_warps=4), # lm_head: 253.9 vs 278.6; whole K -6.0
    (6144, 2560): GemvConfig(block_n=8, block_k=512, split_k=1, num_warps=4),    # qwen3-4b qkv: in graph -12.0 us
    (2560, 4096): GemvConfig(block_n=2, block_k=4096, split_k=1, num_warps=8),   # o: in graph -6.3 us, whole K -16.9
    (19456, 2560): GemvConfig(block_n=8, block_k=512, split_k=1, num_warps=4),   # gate_up: 36.1 vs 39.5
    (2560, 9728): GemvConfig(block_n=16, block_k=256, split_k=6, num_warps=4),   # down: 21.3 vs 22.7 at s4; s6 in graph -9.0 us
    (151936, 2560): GemvConfig(block_n=8, block_k=512, split_k=1, num_warps=4),  # lm_head: 249.9 vs 271.6
    (1536, 1152): GemvConfig(block_n=4, block_k=2048, split_k=1, num_warps=8),   # gemma-3-1b qkv: in graph -2.6, whole K -25.6
    (1152, 1024): GemvConfig(block_n=4, block_k=1024, split_k=1, num_warps=4),   # o: in graph -15.5 us, n4 -3.0
    (13824, 1152): GemvConfig(block_n=16, block_k=256, split_k=1, num_warps=4),  # gate_up: 13.4 vs 14.1
    (1152, 6912): GemvConfig(block_n=16, block_k=256, split_k=8, num_warps=8),   # down: 9.43 vs 10.9; 8 warps in graph -3.2 us
    (262144, 1152): GemvConfig(block_n=16, block_k=256, split_k=1, num_warps=4), # lm_head (tied): 196.6 vs 213.2
}
GEMV_DTYPES = (torch.bfloat16, torch.float16)

# Decode batches of 2-64 rows (custom_ops.triton_skinny): (N, K) -> {rows bucket: choice}, where a
# bucket covers the row counts above the previous one (17..32 is bucket 32, 2..8 is bucket 8), and a
# choice is either the Triton skinny GEMM's config or CUBLASLT, cuBLAS through its Lt interface, which
# picked faster kernels than cuBLAS's default for some shapes. Absent: cuBLAS's default, as torch runs
# it. Picked per shape by `python -m bench gemm --batches ...`: each call timed inside one CUDA graph
# over weight copies >= 3x the L2 (us per call, choice vs cuBLAS's default). 16-64 rows:
# bench/results/h100-2026-11-26/skinny-gemm/; 2-8 rows (picked at 8, within 1-2% of the picks at 2 and
# 4; below 16 rows the kernel pads x to 16 and reads the same weight bytes, so bucket 16 serves 9-15):
# bench/results/h100-2026-11-27/skinny-gemm-2-8-rows/.
CUBLASLT = "cublaslt"
ROW_BUCKETS = (8, 16, 32, 64)
_N64_S1 = GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3)
_N64_S1_ST4 = GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4)
_N128_S1 = GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=4)
_N64_S4 = GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3)
_N64_S4_ST4 = GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4)
_N32_S1 = GemvConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4)
_N32_S2 = GemvConfig(block_n=32, block_k=128, split_k=2, num_warps=4, num_stages=4)
_N16_S1 = GemvConfig(block_n=16, block_k=128, split_k=1, num_warps=4, num_stages=4)
_N64_S6 = GemvConfig(block_n=64, block_k=128, split_k=6, num_warps=4, num_stages=4)
SKINNY_CONFIGS: dict[tuple[int, int], dict[int, GemvConfig | str]] = {
    # llama-3.2-3b (us at 8 / 16 / 32 / 64 rows, cuBLAS's default in brackets; qkv: cuBLAS throughout)
    (3072, 3072): {8: _N64_S4,                                                   # o: 9.92 [11.9]
                   16: GemvConfig(block_n=64, block_k=128, split_k=3, num_warps=4)},   # 10.3 [12.2]
    (16384, 3072): {8: _N64_S1_ST4, 16: _N64_S1, 32: _N64_S1, 64: _N64_S1},  # gate_up: 36.6 / 37.3 / 37.7 / 38.7 [38.4 / 39.0 / 39.5 / 40.3]
    (3072, 8192): {8: _N64_S4, 16: _N64_S4, 32: _N32_S2, 64: CUBLASLT},   # down: 21.2 / 22.0 / 22.9 / 21.9 [23.0 / 24.4 / 25.0 / 24.4]
    (128256, 3072): {8: _N128_S1, 16: _N128_S1, 32: _N128_S1, 64: _N128_S1},  # lm_head: 261 / 263 / 267 / 275 [282 / 284 / 287 / 295]
    # qwen3-4b
    (6144, 2560): {8: _N32_S1, 16: _N32_S1,                                     # qkv: 13.8 / 13.8 [14.6 / 14.5]
                   32: GemvConfig(block_n=16, block_k=128, split_k=1, num_warps=4, num_stages=4)},  # 14.3 [15.1]
    (2560, 4096): {8: _N64_S4, 16: _N64_S4, 32: _N32_S2},       # o: 10.7 / 11.0 / 12.0 [12.3 / 12.5 / 12.6]
    (19456, 2560): {8: _N64_S1, 16: _N64_S1, 32: _N64_S1},      # gate_up: 37.3 / 37.7 / 38.4 [39.9 / 40.5 / 43.5]
    (2560, 9728): {8: _N64_S4_ST4, 16: _N64_S4_ST4, 64: CUBLASLT},   # down: 21.6 / 22.2 / 23.4 [22.9 / 23.3 / 24.5]
    (151936, 2560): {8: _N64_S1_ST4, 16: _N128_S1, 32: _N128_S1, 64: _N128_S1},  # lm_head: 257 / 260 / 265 / 272 [275 / 277 / 281 / 287]
    # gemma-3-1b
    (1536, 1152): {8: _N16_S1, 16: _N16_S1, 32: _N16_S1, 64: _N16_S1},    # qkv: 4.26 / 4.30 / 4.55 / 4.25 [4.82 / 4.51 / 4.89 / 4.87]
    # o at 2-8 rows: 3.79 us alone [4.44], but in the batch-8 decode graph it cost the step 166 us (1.393 ms
    # with cuBLAS there, 1.558 with it; batch 4: 1.351 against 1.336), so cuBLAS (skinny-gemm-2-8-rows/)
    (1152, 1024): {16: _N16_S1, 32: _N16_S1, 64: _N16_S1},    # o: 3.82 / 4.06 / 3.78 [4.51 / 4.53 / 4.60]
    (13824, 1152): {8: _N64_S1, 16: _N64_S1, 32: _N64_S1, 64: _N64_S1},   # gate_up: 12.9 / 13.1 / 13.2 / 13.9 [14.1 / 14.2 / 14.5 / 14.8]
    (1152, 6912): {8: _N64_S6, 16: _N64_S6, 32: _N64_S6},                 # down: 9.04 / 9.3 / 10.6 [11.0 / 11.2 / 11.3]
    (262144, 1152): {8: _N128_S1, 16: _N128_S1, 32: _N128_S1, 64: _N128_S1},  # lm_head: 202 / 206 / 211 / 218 [218 / 221 / 225 / 236]
}


@dataclass(frozen=True)
class TunedTables:
    """The GEMV and skinny-GEMM tables measured on one GPU (`source`: which GPU, which runs)."""

    source: str
    gemv: dict[tuple[int, int], GemvConfig]
    skinny: dict[tuple[int, int], dict[int, GemvConfig | str]]


# compute capability -> its tables. sm_90 (H100; an H200 is the same chip with faster memory, and
# runs these tiles, which were not re-picked on it)
TABLES: dict[tuple[int, int], TunedTables] = {
    (9, 0): TunedTables("H100 80GB HBM3 (SXM, 132 SMs): python -m bench gemm / gemv_graph, bench/results/"
                        "h100-2026-11-2{3,6,7}, h100x2-2026-11-26", GEMV_CONFIGS, SKINNY_CONFIGS),
}
_UNTUNED = TunedTables("none", {}, {})
_by_capability: dict[tuple[int, int], TunedTables] = {}
_capability_of: dict[int, tuple[int, int]] = {}


def tables_for(capability: tuple[int, int]) -> TunedTables:
    """The tables for GPUs of `capability`; empty (cuBLAS everywhere) where none were measured. Which
    it is goes to the log once per capability (a warning when untuned), so a run on a GPU other than
    the one measured says whose tiles it runs."""
    tables = _by_capability.get(capability)
    if tables is None:
        tables = TABLES.get(capability, _UNTUNED)
        if tables is _UNTUNED:
            logger.warning("decode matmuls: no GEMV / skinny-GEMM tuning for compute capability %d.%d (tuned: "
                           "%s): every matmul runs on cuBLAS", *capability,
                           ", ".join(f"{major}.{minor}" for major, minor in TABLES))
        else:
            logger.info("decode matmuls: the GEMV / skinny-GEMM tuning of compute capability %d.%d (%d GEMV and %d "
                        "skinny shapes, measured on %s)", *capability, len(tables.gemv), len(tables.skinny),
                        tables.source.split(":")[0])
        _by_capability[capability] = tables
    return tables


def device_capability(device_index: int | None = None) -> tuple[int, int]:
    """The compute capability of a CUDA device (the current one by default), cached: the property
    query is slow and this is asked at every linear call of eager decode code."""
    index = torch.cuda.current_device() if device_index is None else device_index
    capability = _capability_of.get(index)
    if capability is None:
        capability = _capability_of[index] = torch.cuda.get_device_capability(index)
    return capability


def gemv_config(rows: int, n: int, k: int, dtype: torch.dtype, device_type: str, device_index: int | None = None,
                capability: tuple[int, int] | None = None) -> GemvConfig | str | None:
    """How x [rows, K] @ weight[N, K]^T runs, the one place that decides: at one row the GEMV's config;
    at 2-64 rows the skinny GEMM's config or CUBLASLT; None for cuBLAS's default. The tables are those
    of the GPU's compute capability (`capability`, else that of CUDA device `device_index`, else of the
    current device)."""
    if device_type != "cuda" or dtype not in GEMV_DTYPES:
        return None
    tables = tables_for(capability or device_capability(device_index))
    if rows == 1:
        return tables.gemv.get((n, k))
    if rows < 2 or rows > ROW_BUCKETS[-1]:
        return None
    bucket = next(b for b in ROW_BUCKETS if rows <= b)
    return tables.skinny.get((n, k), {}).get(bucket)


def untuned_shapes(shapes: list[tuple[int, int]], dtype: torch.dtype, device_index: int | None = None,
                   capability: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """The (N, K) of `shapes` that the GPU's table has no one-row GEMV entry for: they run cuBLAS at
    batch 1, without the fusions that need a GEMV (the rotary in the qkv projection's epilogue, the
    activation in the down projection's). Under tensor parallelism every split shape is one until a
    rank's graph is swept (`python -m bench gemv_graph --tp-size N`)."""
    if dtype not in GEMV_DTYPES:
        return []
    return [shape for shape in shapes
            if gemv_config(1, *shape, dtype, "cuda", device_index, capability) is None]


# FP8 weights (custom_ops.fp8: float8_e4m3fn matrices, a float32 scale per row, activations in bf16 /
# fp16). Up to 64 rows the Triton GEMV / skinny GEMM read the FP8 bytes and widen them in registers;
# their tiles come from FP8_GEMV_CONFIGS / FP8_SKINNY_CONFIGS (overrides: benchmarks write them), else
# at one row from FP8_GEMV_TUNED (per compute capability, measured in the decode graph by `bench
# gemv_graph --quantization fp8`), else from the bf16 table's Triton entry for the shape, else from the
# defaults below. Above 64 rows: FP8_LARGE_METHODS per (N, K), else FP8_LARGE_DEFAULT, either DEQUANT (the
# weight widened to the activation dtype, then cuBLAS) or SCALED_MM (torch._scaled_mm on FP8 tensor
# cores, activations quantized per token); the environment variable INFER_GRAPHS_FP8_LARGE
# (dequant | scaled_mm) overrides every shape, for benchmarking. Dequantizing is the default until a
# benchmark shows otherwise: it is exact in the weights' FP8 values, where per-token activation
# quantization adds an error the accuracy goals would have to absorb.
DEQUANT = "dequant"
SCALED_MM = "scaled_mm"
FP8_LARGE_CHOICES = (DEQUANT, SCALED_MM)
FP8_MIN_CAPABILITY = (8, 9)  # FP8 conversions and tensor cores: Ada / Hopper and newer
FP8_GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {}
FP8_GEMV_TUNED: dict[tuple[int, int], dict[tuple[int, int], GemvConfig]] = {
    # sm_90, one H100, llama-3.2-3b's decode graph at 576 cached tokens, the batch-1 step 2.018 -> 1.738 ms
    # (bench/results/h100-2026-12-06/fp8-tiles/); its 3072x8192 down projection kept the bf16 table's tile
    (9, 0): {
        (5120, 3072): GemvConfig(block_n=16, block_k=512, split_k=1, num_warps=8),
        (3072, 3072): GemvConfig(block_n=4, block_k=1024, split_k=1, num_warps=4),
        (16384, 3072): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4),
    },
}
FP8_SKINNY_CONFIGS: dict[tuple[int, int], dict[int, GemvConfig]] = {}
FP8_GEMV_DEFAULT = GemvConfig(block_n=8, block_k=512, split_k=1, num_warps=4)
FP8_SKINNY_DEFAULT = GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4)
FP8_LARGE_METHODS: dict[tuple[int, int], str] = {}
FP8_LARGE_DEFAULT = DEQUANT
FP8_LARGE_ENV = "INFER_GRAPHS_FP8_LARGE"


def fp8_large_method(n: int, k: int, dtype: torch.dtype, device_type: str, device_index: int | None = None,
                     capability: tuple[int, int] | None = None) -> str:
    """DEQUANT or SCALED_MM for an FP8 weight [N, K] above the Triton kernels' rows. SCALED_MM only where
    torch._scaled_mm's row-wise scaling runs: CUDA of capability 9.0 or newer, bf16 activations, N and K
    multiples of 16."""
    import os
    method = os.environ.get(FP8_LARGE_ENV) or FP8_LARGE_METHODS.get((n, k), FP8_LARGE_DEFAULT)
    if method not in FP8_LARGE_CHOICES:
        raise ValueError(f"{FP8_LARGE_ENV}={method!r} is not one of {', '.join(FP8_LARGE_CHOICES)}")
    if method == SCALED_MM and (device_type != "cuda" or dtype != torch.bfloat16 or n % 16 or k % 16
                                or (capability or device_capability(device_index)) < (9, 0)):
        return DEQUANT
    return method


def mark_trace_constants() -> None:
    """Mark fp8_large_method a constant of the trace where Dynamo meets it (an FP8 layer traced without
    the op): configuration, read once per compile, never a guard or a graph break. The compile backend
    calls this before anything is traced; marking at import would import torch._dynamo (~1.1 s on the
    CPU box) into every process that only runs eagerly or parses arguments."""
    torch.compiler.assume_constant_result(fp8_large_method)  # marks the function object itself


def fp8_config(rows: int, n: int, k: int, dtype: torch.dtype, device_type: str, device_index: int | None = None,
               capability: tuple[int, int] | None = None) -> GemvConfig | str:
    """How x [rows, K] @ fp8_weight[N, K]^T (times its row scales) runs, the one place that decides:
    the Triton GEMV's (1 row) or skinny GEMM's (2-64 rows) config on a CUDA GPU with FP8 conversions
    and bf16 / fp16 activations, else fp8_large_method's DEQUANT or SCALED_MM."""
    if device_type == "cuda" and dtype in GEMV_DTYPES and 1 <= rows <= ROW_BUCKETS[-1]:
        capability = capability or device_capability(device_index)
        if capability >= FP8_MIN_CAPABILITY:
            tables = TABLES.get(capability, _UNTUNED)
            if rows == 1:
                return (FP8_GEMV_CONFIGS.get((n, k)) or FP8_GEMV_TUNED.get(capability, {}).get((n, k))
                        or tables.gemv.get((n, k)) or FP8_GEMV_DEFAULT)
            bucket = next(b for b in ROW_BUCKETS if rows <= b)
            bf16 = tables.skinny.get((n, k), {}).get(bucket)
            return (FP8_SKINNY_CONFIGS.get((n, k), {}).get(bucket)
                    or (bf16 if isinstance(bf16, GemvConfig) else None) or FP8_SKINNY_DEFAULT)
    return fp8_large_method(n, k, dtype, device_type, device_index, capability)
