"""Suite `gemm`: the decode matmuls of a model, timed kernel by kernel against memory bandwidth.

For each linear layer shape of the model (fused qkv, o, fused gate_up, down, the LM head) at decode
batch sizes (default 1 and 8), `out = x @ W^T` in bf16 by:
  cublas              F.linear as the engine runs it (torch defaults);
  cublas_fp32_reduce  F.linear with allow_bf16_reduced_precision_reduction off (cuBLAS may not
                      reduce split-K partials in bf16: changes which split-K kernels it picks);
  cublaslt            F.linear with torch.backends.cuda.preferred_blas_library("cublaslt");
  triton_gemv         at one row: custom_ops.triton_gemv at every config of CONFIGS (the best one
                      is reported, the whole sweep is in the JSON's meta);
  triton_skinny       from 2 rows: custom_ops.triton_skinny at every config of skinny_configs.
Each kernel is timed inside one CUDA graph that runs it over enough copies of W that the L2 never
holds the weight it reads (as in a model step, where a layer's weights were last read a step ago);
time per call = graph replay time / calls. GB/s counts W + x + out bytes; `x_copy` and `x_read` are
the fractions of the copy bandwidth (bench.floor's ceiling, read + write) and of a read-only pass
measured in the same run. A variant whose result differs from cuBLAS's (relative error > 2e-2) is
reported and never picked. The `pick` rows name the fastest variant per (shape, batch): the table a
run-time choice reads (custom_ops/gemv_table.py holds the batch-1 picks of an H100 run, used under
EngineConfig.decode_gemv).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bench.common import parse_ints, rel_err
from bench.configs import load_config
from bench.measure import Report, measure_ceilings, median_ms

BATCHES = (1, 8)
COLUMNS = ["shape", "batch", "n", "k", "weight_mib", "variant", "config", "us", "gbps", "x_copy", "x_read", "rel_err"]
MAX_REL_ERR = 2e-2


def _triton_configs():
    from custom_ops.triton_gemv import GemvConfig
    tiles = ((8, 512), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128))
    return tuple(GemvConfig(block_n=n, block_k=k, split_k=s, num_warps=4) for n, k in tiles for s in (1, 2, 4, 8))


CONFIGS = _triton_configs()


def skinny_configs(n: int, k: int) -> tuple:
    """The skinny GEMM's candidates at 2-64 rows (custom_ops.triton_skinny): narrow weight tiles
    (x on the MMA's left side) unsplit and split in two, and 64/128-row tiles with the two smallest
    splits that give >= 100 programs. 128-key tiles: 64-key ones lost every llama-3.2-3b shape."""
    from custom_ops.gemv_table import GemvConfig
    out = [GemvConfig(block_n=bn, block_k=128, split_k=s, num_warps=4, num_stages=4) for bn in (16, 32) for s in (1, 2)]
    for bn in (64, 128):
        tiles = math.ceil(n / bn)
        splits = [s for s in (1, 2, 3, 4, 6, 8) if tiles * s >= 100 and math.ceil(k / 128) % s == 0][:2] or [8]
        out += [GemvConfig(block_n=bn, block_k=128, split_k=s, num_warps=4, num_stages=st)
                for s in splits for st in (3, 4)]
    return tuple(out)


def rank_config(config: dict, tp_size: int) -> dict:
    """A model config (HF fields) whose layers have the shapes of one rank of `tp_size`-way tensor
    parallelism, by the models' own split rules: q heads and the intermediate size divided, KV heads
    divided or replicated (HeadSplit.of), the vocabulary ceil(V / N) rows (vocab_range), head_dim kept.
    Built on one GPU, such a model runs one rank's decode matmuls and attention without the collectives:
    what the GEMV tables need measured for tensor parallelism (they are keyed by shape)."""
    if tp_size == 1:
        return dict(config)
    from types import SimpleNamespace
    from models.config import ModelConfig
    from models.parallel import HeadSplit, check_divides, vocab_range
    cfg = ModelConfig.from_hf(config, "bfloat16")
    rank0 = SimpleNamespace(rank=0, world_size=tp_size)  # the split rules read only these two
    heads = HeadSplit.of(cfg.num_heads, cfg.num_kv_heads, rank0)
    check_divides(tp_size, cfg.intermediate_size, "intermediate_size")
    return {**config, "num_attention_heads": heads.num_heads, "num_key_value_heads": heads.num_kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size // tp_size,
            "vocab_size": vocab_range(cfg.vocab_size, rank0)[2]}


def model_gemm_shapes(model: str, tp_size: int = 1) -> list[tuple[str, int, int]]:
    """(name, N, K) of every decode matmul of a model on one rank of `tp_size`, as its layers run
    them: fused qkv and gate_up (column-parallel: heads and intermediate size split), o and down
    (row-parallel: their K split), and the vocab-parallel LM head."""
    from models.config import ModelConfig
    cfg = ModelConfig.from_hf(rank_config(load_config(model), tp_size), "bfloat16")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("qkv", q + 2 * kv, cfg.hidden_size), ("o", cfg.hidden_size, q),
            ("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size), ("down", cfg.hidden_size, cfg.intermediate_size),
            ("lm_head", cfg.vocab_size, cfg.hidden_size)]


@contextlib.contextmanager
def cublas_setting(variant: str):
    """The torch matmul settings of a cuBLAS variant, restored afterwards."""
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    library = torch.backends.cuda.preferred_blas_library()
    try:
        if variant == "cublas_fp32_reduce":
            matmul.allow_bf16_reduced_precision_reduction = False
        elif variant == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced
        torch.backends.cuda.preferred_blas_library(library)


def graph_us_per_call(fn, weights: list[torch.Tensor], iters: int = 20) -> float:
    """Microseconds per fn(w) call, from one CUDA graph calling fn once per weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)  # compiles (Triton), picks algorithms and workspaces (cuBLAS) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    ms = median_ms(graph.replay, warmup=3, iters=iters)
    del graph
    return ms * 1e3 / len(weights)


def read_bytes_per_s() -> float:
    """A read-only pass over 2 GiB (a sum): the bandwidth a GEMV, which only reads, can reach."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    ms = median_ms(lambda: x.sum(dtype=torch.float32), warmup=3, iters=20)
    return x.numel() * x.element_size() / (ms * 1e-3)


def weight_copies(n: int, k: int, l2_bytes: int) -> list[torch.Tensor]:
    """Enough random [N, K] bf16 copies that a round over them is >= 3x the L2 (at least 2 copies)."""
    nbytes = n * k * 2
    count = max(2, math.ceil(3 * l2_bytes / nbytes))
    return [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5 for _ in range(count)]


def measure_shape(n: int, k: int, batch: int, l2_bytes: int, configs=None) -> list[dict]:
    """Every variant at one shape: dicts with variant, config, us, rel_err (vs cuBLAS default). The
    Triton variant is the GEMV at one row and the skinny GEMM from 2 rows (custom_ops.triton_skinny)."""
    from custom_ops.triton_gemv import gemv
    from custom_ops.triton_skinny import fits, skinny_gemm
    skinny = fits(batch)
    if configs is None:
        configs = skinny_configs(n, k) if skinny else CONFIGS
    triton_variant, kernel = ("triton_skinny", skinny_gemm) if skinny else ("triton_gemv", gemv)
    weights = weight_copies(n, k, l2_bytes)
    x = torch.randn(batch, k, dtype=torch.bfloat16, device="cuda")
    reference = F.linear(x, weights[0]).float()
    results = []
    for variant in ("cublas", "cublas_fp32_reduce", "cublaslt"):
        with cublas_setting(variant):
            err = rel_err(F.linear(x, weights[0]), reference)
            results.append(dict(variant=variant, config="-", us=graph_us_per_call(lambda w: F.linear(x, w), weights),
                                rel_err=err))
    out = torch.empty(batch, n, dtype=torch.bfloat16, device="cuda")
    for cfg in configs:
        if cfg.split_k > 1 and math.ceil(k / cfg.block_k) < cfg.split_k:
            continue  # more splits than K tiles: some splits would get no work
        try:
            err = rel_err(kernel(x, weights[0], cfg, out=out), reference)
            us = graph_us_per_call(lambda w: kernel(x, w, cfg, out=out), weights)
        except Exception as exc:  # a config the compiler or the device refuses must not lose the run
            results.append(dict(variant=triton_variant, config=cfg.label(), us=None, rel_err=None,
                                error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
            continue
        results.append(dict(variant=triton_variant, config=cfg.label(), us=us, rel_err=err))
    del weights
    torch.cuda.empty_cache()
    return results


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("the gemm suite needs a CUDA device: it times cuBLAS and Triton kernels")


def l2_cache_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def run(model: str, batches=None, tp_size: int = 1, **_: object) -> Report:
    """`tp_size`: time the shapes one rank of that many runs (the GEMV table is keyed by shape)."""
    _require_cuda()
    batches = parse_ints(batches, BATCHES)
    ceilings = measure_ceilings()
    read_bw = read_bytes_per_s()
    l2_bytes = l2_cache_bytes()
    report = Report("gemm", model if tp_size == 1 else f"{model}-tp{tp_size}", ceilings.device_name, COLUMNS)
    report.meta.update(torch=torch.__version__, copy_bytes_per_s=ceilings.copy_bytes_per_s, read_bytes_per_s=read_bw,
                       l2_bytes=l2_bytes, batches=batches, tp_size=tp_size, sweep=[])
    report.notes.append(f"copy bandwidth {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s (read + write), read-only "
                        f"{read_bw / 1e12:.2f} TB/s; each time is a CUDA-graph replay over weight copies >= 3x L2")
    picks = {}
    for name, n, k in model_gemm_shapes(model, tp_size):
        for batch in batches:
            nbytes = (n * k + batch * k + batch * n) * 2
            results = measure_shape(n, k, batch, l2_bytes)
            for r in results:
                report.meta["sweep"].append(dict(shape=name, batch=batch, **r))
            best_triton = min((r for r in results if r["variant"].startswith("triton_") and r["us"] is not None
                               and r["rel_err"] <= MAX_REL_ERR), key=lambda r: r["us"], default=None)
            shown = [r for r in results if not r["variant"].startswith("triton_")] + ([best_triton] if best_triton else [])
            for r in shown:
                gbps = nbytes / (r["us"] * 1e-6) / 1e9
                report.add(shape=name, batch=batch, n=n, k=k, weight_mib=n * k * 2 / 2**20, variant=r["variant"],
                           config=r["config"], us=r["us"], gbps=gbps, x_copy=gbps * 1e9 / ceilings.copy_bytes_per_s,
                           x_read=gbps * 1e9 / read_bw, rel_err=r["rel_err"])
            valid = [r for r in shown if r["rel_err"] <= MAX_REL_ERR]
            best = min(valid, key=lambda r: r["us"])
            cublas_us = next(r["us"] for r in results if r["variant"] == "cublas")
            picks.setdefault(name, {})[batch] = dict(variant=best["variant"], config=best["config"], us=best["us"],
                                                     speedup_vs_cublas=cublas_us / best["us"])
            gbps = nbytes / (best["us"] * 1e-6) / 1e9
            report.add(shape=name, batch=batch, n=n, k=k, weight_mib=n * k * 2 / 2**20,
                       variant="pick: " + best["variant"], config=best["config"], us=best["us"], gbps=gbps,
                       x_copy=gbps * 1e9 / ceilings.copy_bytes_per_s, x_read=gbps * 1e9 / read_bw,
                       rel_err=best["rel_err"])
            failed = [r["config"] for r in results if r["us"] is None]
            if failed:
                report.notes.append(f"{name} batch {batch}: triton configs that failed (errors in meta.sweep): "
                                    + ", ".join(failed))
    report.meta["picks"] = picks
    report.notes.append(step_note(model, picks, report.rows, read_bw))
    return report


def step_note(model: str, picks: dict, rows: list[dict], read_bytes_per_s: float) -> str:
    """What one decode step's matmuls cost per batch: every layer's four plus the LM head, with
    cuBLAS as the engine runs it and with the picks, against reading their weights at read bandwidth."""
    layers = load_config(model)["num_hidden_layers"]
    parts = []
    for batch in sorted({b for per in picks.values() for b in per}):
        def total(us_of) -> float:
            return sum((1 if name == "lm_head" else layers) * us_of(name) for name in picks) / 1e3
        cublas = total(lambda name: next(r["us"] for r in rows if r["shape"] == name and r["batch"] == batch
                                         and r["variant"] == "cublas"))
        picked = total(lambda name: picks[name][batch]["us"])
        floor = total(lambda name: next(r["weight_mib"] for r in rows if r["shape"] == name) * 2**20
                      / read_bytes_per_s * 1e6)
        parts.append(f"batch {batch}: cuBLAS {cublas:.3f} ms, picks {picked:.3f} ms, read floor {floor:.3f} ms")
    return f"one decode step's matmuls ({layers} layers x 4 + LM head): " + "; ".join(parts)
