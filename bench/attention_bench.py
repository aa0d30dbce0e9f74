"""Attention kernel benchmark: decode bandwidth against the device copy ceiling, prefill against SDPA.

    python -m bench.attention_bench --out bench/results/h100-YYYY-MM-DD

- copy ceiling: a 1 GiB device-to-device copy, bytes read + written.
- decode (Llama-3-8B heads: 32 q heads, 8 kv heads, D 128, bf16, 16-token pages scattered at
  random): the whole op (split-K decode with the store and the split merge fused in) captured in a
  CUDA graph, as the engine runs it; bytes = KV read + q read + out written + the new K/V stored.
  Fraction of the copy ceiling.
  A sweep over split counts and tile configs shows where the heuristic lands.
- prefill: one causal sequence of T tokens, dense path and paged path (store + paged prefill), against
  `scaled_dot_product_attention` with the flash backend on the same shapes.

Times are medians of `triton.testing.do_bench` (events; it clears L2 before every call, so a KV cache
smaller than L2 is still read from HBM). Writes attention.json and attention.md to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform

import torch
import triton
from triton.testing import do_bench

from custom_ops import AttentionLayer, AttentionMetadata
from custom_ops import triton_attention
from custom_ops.triton_common import sm_count
from custom_ops.triton_decode import decode_config, decode_num_splits

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def median_ms(fn, rep_ms: int = 200) -> float:
    return float(do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbps() -> float:
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def layer_of(num_heads, num_kv_heads, head_dim, window=None, softcap=None) -> AttentionLayer:
    return AttentionLayer(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window, softcap)


def decode_setup(batch: int, context: int, layer: AttentionLayer, block_size=16, dtype=torch.bfloat16,
                 num_layers: int = 1):
    """A decode step where each sequence holds `context` tokens, the last one new; pages shuffled.
    `num_layers` caches share the metadata, as the layers of one model do."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = 1 + batch * blocks_per_seq
    caches = [torch.randn(2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype=dtype,
                          device="cuda") for _ in range(num_layers)]
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, blocks_per_seq).to(torch.int32)
    last = context - 1
    slots = tables[:, last // block_size].long() * block_size + last % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"), block_tables=tables,
        num_actual_tokens=batch, max_query_len=1, max_seq_len=context, is_uniform_decode=True)
    q = torch.randn(batch, layer.num_heads, layer.head_dim, dtype=dtype, device="cuda")
    k = torch.randn(batch, layer.num_kv_heads, layer.head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    return q, k, v, out, caches, meta


def graphed(fn):
    """Capture fn in a CUDA graph (after a warm-up that compiles) and return the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_decode(batch, context, copy_gbps, num_splits=None, config=None, layer=None, fuse=True):
    """Two timings of the whole op in a CUDA graph:
    - `ms` (headline): one graph runs the op for N layers, each over its own KV cache (N such that the
      caches total >= 1.5 GB, so nothing is served from L2), time / N. This is how a model's decode
      step meets the kernel: back to back with the other layers, no L2 flush in between.
    - `cold_ms`: one call right after do_bench's L2 clear; that clear leaves up to 50 MB of dirty
      lines the kernel's reads must evict (write back), a fixed cost that weighs on small steps."""
    layer = layer or layer_of(**LLAMA3_8B)
    elem = 2
    visible = min(context, layer.sliding_window or context)  # keys before the window are never read
    kv_bytes = 2 * batch * visible * layer.num_kv_heads * layer.head_dim * elem
    num_layers = max(1, min(16, math.ceil(1.5e9 / kv_bytes)))
    q, k, v, out, caches, meta = decode_setup(batch, context, layer, num_layers=num_layers)
    kwargs = dict(num_splits=num_splits, config=config, fuse_store=fuse)

    def one():
        triton_attention.paged_attention(q, k, v, out, layer, caches[0], meta, **kwargs)

    def all_layers():
        for cache in caches:
            triton_attention.paged_attention(q, k, v, out, layer, cache, meta, **kwargs)

    cold_ms = median_ms(graphed(one))
    ms = median_ms(graphed(all_layers)) / num_layers
    io_bytes = 2 * q.numel() * elem + 2 * 2 * k.numel() * elem  # q in, out, new k/v read + stored
    total = kv_bytes + io_bytes
    gbps = total / (ms * 1e-3) / 1e9
    splits = num_splits or decode_num_splits(batch, layer.num_kv_heads, visible,
                                             sm_count(torch.device("cuda", 0)),
                                             dict(decode_config(layer.head_dim), **(config or {}))["BLOCK_N"])
    shape = f"{layer.num_heads}/{layer.num_kv_heads}/{layer.head_dim}"
    if layer.sliding_window or layer.logit_softcap:
        shape += f" (w {layer.sliding_window}, cap {layer.logit_softcap})"
    return dict(batch=batch, context=context, shape=shape, num_splits=splits, config=config or "default",
                fused_store=fuse, layers=num_layers, ms=ms, bytes=total, gbps=gbps,
                fraction_of_copy=gbps / copy_gbps, cold_ms=cold_ms,
                cold_fraction_of_copy=total / (cold_ms * 1e-3) / 1e9 / copy_gbps)


def prefill_flops(t, layer):
    return 4 * layer.num_heads * layer.head_dim * t * (t + 1) / 2  # causal: half of QK^T and PV


def bench_prefill(t, layer, dtype=torch.bfloat16, config=None, paths=("sdpa", "dense", "paged")):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.randn(t, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(t, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    row = dict(tokens=t, num_heads=hq, num_kv_heads=hkv, head_dim=d, config=config or "default")
    flops = prefill_flops(t, layer)
    if "sdpa" in paths:
        # SDPA gets its preferred layout ([1, H, T, D] contiguous) and K/V expanded to all heads
        qs = q.transpose(0, 1).contiguous()[None]
        ks = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).contiguous()[None]
        vs = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1).contiguous()[None]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = median_ms(graphed(lambda: torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=layer.scale)))
        row["sdpa_flash_ms"] = ms
    if "dense" in paths:
        ms = median_ms(graphed(lambda: triton_attention.dense_causal_attention(q, k, v, out, layer, config=config)))
        row["dense_ms"] = ms
        row["dense_tflops"] = flops / (ms * 1e-3) / 1e12
    if "paged" in paths:
        block_size = 16
        blocks = math.ceil(t / block_size)
        cache = torch.randn(2, blocks + 1, block_size, hkv, d, dtype=dtype, device="cuda")
        table = (torch.randperm(blocks, device="cuda") + 1).to(torch.int32)[None]
        pos = torch.arange(t, device="cuda")
        meta = AttentionMetadata(
            slot_mapping=table[0, pos // block_size].long() * block_size + pos % block_size,
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device="cuda"),
            seq_lens=torch.tensor([t], dtype=torch.int32, device="cuda"), block_tables=table,
            num_actual_tokens=t, max_query_len=t, max_seq_len=t)
        call = lambda: triton_attention.paged_attention(q, k, v, out, layer, cache, meta, config=config)  # noqa: E731
        ms = median_ms(graphed(call))
        row["paged_ms"] = ms
        # eager: Python + two Triton launches; at small T the host, not the GPU, sets this time
        row["paged_eager_ms"] = median_ms(call)
        row["paged_tflops"] = flops / (ms * 1e-3) / 1e12
    if "sdpa_flash_ms" in row:
        for path in ("dense", "paged"):
            if f"{path}_ms" in row:
                row[f"{path}_vs_sdpa"] = row[f"{path}_ms"] / row["sdpa_flash_ms"]
    return row


def safe(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # a sweep config that does not compile (shared memory) is a data point
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}", args=repr(args), kwargs=repr(kwargs))


def run(sweep: bool = True) -> dict:
    props = torch.cuda.get_device_properties(0)
    report = dict(
        device=torch.cuda.get_device_name(0), sm_count=props.multi_processor_count,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
    copy_gbps = copy_bandwidth_gbps()
    report["copy_gbps"] = copy_gbps
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)

    report["decode"] = [bench_decode(b, c, copy_gbps) for b, c in
                        [(32, 4096), (1, 8192), (1, 32768), (8, 2048), (64, 1024), (128, 512)]]
    report["decode"] += [bench_decode(1, 8192, copy_gbps, layer=layer_of(8, 1, 256, window=4096, softcap=50.0)),
                         bench_decode(32, 4096, copy_gbps, layer=layer_of(8, 1, 256, window=1024, softcap=50.0))]
    for r in report["decode"]:
        print(r, flush=True)
    if sweep:
        report["decode_sweep"] = []
        for b, c, splits_list in [(1, 8192, [16, 32, 64]), (32, 4096, [1, 2, 4])]:
            report["decode_sweep"].append(safe(bench_decode, b, c, copy_gbps, fuse=False))
            for s in splits_list:
                report["decode_sweep"].append(safe(bench_decode, b, c, copy_gbps, num_splits=s))
            for cfg in [dict(BLOCK_N=32, num_warps=4, num_stages=3), dict(BLOCK_N=64, num_warps=4, num_stages=3),
                        dict(BLOCK_N=128, num_warps=4, num_stages=2)]:
                report["decode_sweep"].append(safe(bench_decode, b, c, copy_gbps, config=cfg))
        for r in report["decode_sweep"]:
            print(r, flush=True)

    llama = layer_of(**LLAMA3_8B)
    report["prefill"] = [bench_prefill(t, llama) for t in (512, 1024, 2048, 4096)]
    report["prefill"] += [bench_prefill(2048, layer_of(8, 1, 256)), bench_prefill(2048, layer_of(16, 4, 64))]
    for r in report["prefill"]:
        print(r, flush=True)
    if sweep:
        report["prefill_sweep"] = []
        for t in (512, 4096):
            for cfg in [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)]:
                report["prefill_sweep"].append(safe(bench_prefill, t, llama, config=cfg, paths=("dense", "paged")))
        for cfg in [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)]:
            report["prefill_sweep"].append(
                safe(bench_prefill, 2048, layer_of(8, 1, 256), config=cfg, paths=("dense", "paged")))
        for r in report["prefill_sweep"]:
            print(r, flush=True)
    return report


def markdown(report: dict) -> str:
    lines = [f"# Attention kernels: {report['device']} ({report['sm_count']} SMs), {report['date']}", "",
             f"torch {report['torch']}, triton {report['triton']}. Copy ceiling (1 GiB D2D, read + write): "
             f"**{report['copy_gbps']:.0f} GB/s**.", "",
             "## Decode (bf16, 16-token pages scattered at random, store + attention in a CUDA graph)", "",
             "Time per layer from one graph over N layers' caches (no L2 reuse); cold: one call after an "
             "L2 clear (includes writing back the clear's dirty lines).", "",
             "| batch | context | Hq/Hkv/D (window, softcap) | splits | time (us) | GB/s | fraction of copy | "
             "cold (us) | cold fraction |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["decode"]:
        shape = r.get("shape", "32/8/128")
        lines.append(f"| {r['batch']} | {r['context']} | {shape} | {r['num_splits']} | {r['ms'] * 1e3:.1f} | "
                     f"{r['gbps']:.0f} | **{r['fraction_of_copy']:.2f}** | {r['cold_ms'] * 1e3:.1f} | "
                     f"{r['cold_fraction_of_copy']:.2f} |")
    lines += ["", "## Prefill (one causal sequence, bf16) against SDPA flash (each in a CUDA graph)", "",
              "paged = store kernel + paged prefill over 16-token pages; dense = the op without context.", "",
              "| T | Hq/Hkv/D | SDPA flash (ms) | dense (ms) | dense / SDPA | dense TFLOP/s | paged (ms) | "
              "paged / SDPA | paged eager (ms) |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["prefill"]:
        lines.append(f"| {r['tokens']} | {r['num_heads']}/{r['num_kv_heads']}/{r['head_dim']} | "
                     f"{r['sdpa_flash_ms']:.3f} | {r['dense_ms']:.3f} | {r['dense_vs_sdpa']:.2f}x | "
                     f"{r['dense_tflops']:.0f} | {r['paged_ms']:.3f} | **{r['paged_vs_sdpa']:.2f}x** | "
                     f"{r['paged_eager_ms']:.3f} |")
    for key in ("decode_sweep", "prefill_sweep"):
        if report.get(key):
            lines += ["", f"## {key.replace('_', ' ')}", ""]
            for r in report[key]:
                lines.append("- " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in r.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for attention.json / attention.md")
    parser.add_argument("--no-sweep", action="store_true", help="skip the split-count / tile sweeps")
    args = parser.parse_args(argv)
    report = run(sweep=not args.no_sweep)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(report, f, indent=2)
    md = markdown(report)
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
