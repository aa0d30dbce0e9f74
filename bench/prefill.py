"""Suite `prefill`: latency of one prompt of T tokens (forward + last token's logits), one sequence.

  eager             our model as an nn.Module (attention op through the dispatcher)
  compiled          infer_graphs backend, RuntimeMode.NONE: Inductor pieces, no graphs
  piecewise         infer_graphs backend, RuntimeMode.PIECEWISE: one graph per piece at T tokens;
                    its gpu_ms is the step's GPU time with the host far ahead (bench.measure.
                    gpu_ms_host_ahead): well under median_ms, the row is host-bound (the attention
                    launches between the pieces), not GPU-bound
  full_graph        the compiled forward captured whole as ONE native graph at T (FULL mode):
                    the no-launch-overhead ideal piecewise is compared with
  full_graph_eager  the un-compiled forward captured as one graph: launches gone, kernels unfused
  hf_eager          transformers, same config, one forward with logits_to_keep=1
Attention writes the prompt's K/V into a paged cache (as the engine's prefill does).
Floor = max(weight bytes / copy bandwidth, (2 * matmul params * T + logits) / matmul rate).
"""
from __future__ import annotations

import logging

import torch

from bench.common import build_model, free_device_memory, parse_ints, rel_err
from bench.configs import load_config
from bench.floors import model_cost, prefill_floor_ms
from bench.measure import Report, gpu_ms_host_ahead, measure_ceilings, median_ms, plot_latency_vs_floor, ratio
from bench.paged import PagedKV, blocks_per_seq, step_inputs, step_metadata

TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
COLUMNS = ["variant", "tokens", "median_ms", "gpu_ms", "floor_ms", "x_floor", "x_full_graph", "tokens_per_s"]
logger = logging.getLogger("bench")


def run(model: str, tokens=None, peers: str | None = None, iters: int = 20, **_: object) -> Report:
    from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim
    from custom_ops import RuntimeMode

    tokens = parse_ints(tokens, TOKENS)
    peers = peers or "all"
    on_cuda = torch.cuda.is_available()
    ceilings = measure_ceilings() if on_cuda else None
    net = build_model(model)
    cost = model_cost(net)
    report = Report("prefill", model, ceilings.device_name if ceilings else "cpu", COLUMNS)
    report.meta.update(weight_bytes=cost.weight_bytes, matmul_params=cost.matmul_params, tokens=tokens,
                       copy_bytes_per_s=ceilings.copy_bytes_per_s if ceilings else None,
                       matmul_flops_per_s=ceilings.matmul_flops_per_s if ceilings else None,
                       torch=torch.__version__)
    results: dict[tuple[str, int], float] = {}

    def add(variant: str, t: int, ms: float) -> None:
        floor = prefill_floor_ms(cost, t, ceilings.copy_bytes_per_s, ceilings.matmul_flops_per_s) if ceilings else None
        results[(variant, t)] = ms
        report.add(variant=variant, tokens=t, median_ms=ms, floor_ms=floor, x_floor=ratio(ms, floor),
                   tokens_per_s=t / ms * 1e3)

    kv = PagedKV.allocate(net, 1 + blocks_per_seq(max(tokens)))
    backend = InferGraphsBackend(BackendConfig(capture_sizes=tuple(tokens)))
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    device = net.model.embed_tokens.weight.device
    graphs = {}
    with torch.inference_mode():
        for t in sorted(tokens, reverse=True):  # largest first: smaller graphs reuse the pool's blocks
            meta = step_metadata(1, 0, t, device)
            ids, pos = step_inputs(1, 0, t, net.config.vocab_size, device, seed=t)

            def run_model(fn, mode):
                with kv.context(meta, mode, t):
                    if fn is compiled:
                        mark_token_dim(ids, pos)
                    hidden = fn(ids, pos)
                return net.compute_logits(hidden[-1:])

            ms_eager = median_ms(lambda: run_model(net, RuntimeMode.NONE), iters=iters)
            reference = run_model(net, RuntimeMode.NONE).float()
            ms_compiled = median_ms(lambda: run_model(compiled, RuntimeMode.NONE), iters=iters)
            ms_piece = gpu_ms_piece = ms_full = ms_full_eager = None
            if on_cuda:  # on the CPU nothing is captured: a "piecewise" row would time the compiled pieces again
                ms_piece = median_ms(lambda: run_model(compiled, RuntimeMode.PIECEWISE), iters=iters)
                gpu_ms_piece = gpu_ms_host_ahead(lambda: run_model(compiled, RuntimeMode.PIECEWISE))
                piece_err = rel_err(run_model(compiled, RuntimeMode.PIECEWISE), reference)
                for variant, fn in (("full_graph", compiled), ("full_graph_eager", net)):
                    run_model(fn, RuntimeMode.FULL)  # warm-up outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=backend.pool):
                        out = run_model(fn, RuntimeMode.FULL)
                    graphs[(variant, t)] = (graph, out, meta, ids, pos)
                    ms = median_ms(graph.replay, iters=iters)
                    if variant == "full_graph":
                        ms_full = ms
                    else:
                        ms_full_eager = ms
            add("eager", t, ms_eager)
            add("compiled", t, ms_compiled)
            if ms_piece is not None:
                add("piecewise", t, ms_piece)
                report.rows[-1]["piecewise_vs_eager_rel_err"] = piece_err
                report.rows[-1]["gpu_ms"] = gpu_ms_piece
            if ms_full is not None:
                add("full_graph", t, ms_full)
                add("full_graph_eager", t, ms_full_eager)
    if not on_cuda:
        report.notes.append("no piecewise or full-graph rows: graphs are captured on CUDA only")
    report.meta["backend_stats"] = {k: v for k, v in vars(backend.stats).items() if k != "capture_seconds"}
    graphs.clear()
    kv.release()
    del compiled, backend, net
    torch._dynamo.reset()
    free_device_memory()

    if peers in ("all", "eager"):
        from bench import hf_peers
        hf = hf_peers.hf_model(load_config(model), device="cuda" if on_cuda else "cpu",
                               dtype=torch.bfloat16 if on_cuda else torch.float32)
        with torch.no_grad():
            for t in tokens:
                add("hf_eager", t, median_ms(hf_peers.prefill_eager_step(hf, t), iters=iters))
        del hf
        free_device_memory()
    for row in report.rows:
        full = results.get(("full_graph", row["tokens"]))
        row["x_full_graph"] = ratio(row["median_ms"], full)
        hf = results.get(("hf_eager", row["tokens"]))
        if hf is not None:
            row["speedup_vs_hf_eager"] = hf / row["median_ms"]
    report.columns = COLUMNS + ["speedup_vs_hf_eager"]
    report.rows.sort(key=lambda r: (r["tokens"], r["variant"]))
    report.plots.append(("latency", plot_prefill))
    return report


def plot_prefill(report: Report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_latency_vs_floor(ax, report.rows, "tokens", "prompt tokens", "ms per prefill", f"prefill, {report.model}")
    return fig
