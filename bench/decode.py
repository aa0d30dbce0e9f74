"""Suite `decode`: per-step latency of one decode step (forward + logits) by batch and context.

Ours, through the engine's own runner (its static buffers and its full-decode graphs):
  eager        the model as an nn.Module, attention op through the dispatcher;
  compiled     torch.compile with the infer_graphs backend, RuntimeMode.NONE (pieces, no graphs);
  full_graph   the engine's native decode graph for the batch (engine.worker.decode_graphs), replayed;
               with --decode-gemv, from an engine with EngineConfig.decode_gemv=False (cuBLAS only);
  full_graph_gemv  (--decode-gemv) the same from a second engine with EngineConfig.decode_gemv=True
               (the default): the Triton GEMV at batch 1 where custom_ops/gemv_table.py has the shape.
  full_graph_fp8  (--quantization fp8) the decode graphs of one more engine over the same model with FP8
               weights (EngineConfig.quantization="fp8", custom_ops/fp8.py); its floor_ms is the FP8
               model's (its weight bytes), and vs_cublas_eager_rel_err compares with that FP8 model eager.
Peers, same process, same GPU:
  ours_reduce_overhead  torch.compile(mode="reduce-overhead") on our model (Inductor + cudagraph trees);
  hf_eager              transformers' generate() (greedy, its default DynamicCache), as its users
                        run it;
  hf_static_compiled    transformers' generate(cache_implementation="static"), which compiles its
                        decode step with torch.compile(mode="reduce-overhead").
  Both peers: per-step time from two generation lengths, (t(long) - t(short)) / (long - short) with
  exact lengths, from a prompt of `context` tokens (prefill and set-up cancel).
Floor = (weight bytes + batch * K/V bytes attended) / copy bandwidth.
"""
from __future__ import annotations

import logging

import torch

from bench.common import Deadline, build_model, free_device_memory, parse_ints, rel_err
from bench.configs import load_config
from bench.floors import decode_floor_ms, model_cost
from bench.measure import Report, measure_ceilings, median_ms, plot_latency_vs_floor, ratio
from bench.paged import BLOCK_SIZE, blocks_per_seq, step_metadata

BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (512, 4096)
PEER_POINTS = ((1, 512), (32, 512), (1, 4096), (32, 4096))   # eager peers (no compile; ~10 s each)
COMPILED_PEER_POINTS = ((1, 512),)                            # each costs a full-model compile
EAGER_GENERATE_LENGTHS = {"short": 8, "long": 24}  # 16 steps of ~35 ms (llama-3.2-3b, H100): ~0.6 s of signal
KV_MEMORY_FRACTION = 0.8  # of the memory free after the weights, for the pool of the largest point

logger = logging.getLogger("bench")

COLUMNS = ["variant", "batch", "context", "median_ms", "floor_ms", "x_floor", "tokens_per_s"]


def _points_that_fit(points, kv_bytes_per_token: int, free_bytes: int) -> tuple[list, list]:
    fit, skipped = [], []
    for b, c in points:
        need = b * blocks_per_seq(c + 1) * BLOCK_SIZE * kv_bytes_per_token
        (fit if need <= KV_MEMORY_FRACTION * free_bytes else skipped).append((b, c))
    return fit, skipped


def load_decode_step(runner, vocab_size: int, batch: int, context: int):
    """A decode step of `batch` sequences at `context` cached tokens into the engine runner's static
    buffers (random ids; each sequence its own blocks, bench.paged.step_metadata); the metadata
    viewing those buffers."""
    meta = step_metadata(batch, context, 1, "cpu")
    ids = torch.randint(0, vocab_size, (batch,)).tolist()
    runner.buffers.load(ids, [context] * batch, meta.slot_mapping.tolist(), meta.query_start_loc.tolist(),
                        meta.seq_lens.tolist(), meta.block_tables.tolist(), list(range(batch)),
                        *_window_group_step(runner, batch, context))
    return runner.buffers.metadata(batch, batch, batch, 1, context + 1, True)


def _window_group_step(runner, batch: int, context: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Slots and block tables of the engine's sliding-window KV groups (engine.kv.groups) for
    load_decode_step: each sequence its own blocks for the window of its query at `context` (the
    scratch block before it, as the pool leaves them), ids wrapped into the group's pool."""
    from custom_ops import SCRATCH_BLOCK, get_attention_layer
    size = runner.block_size
    group_slots, group_tables = [], []
    for names in runner.group_layers:
        usable = runner.kv_caches[names[0]].shape[1] - 1
        first = max(0, context - get_attention_layer(names[0]).sliding_window + 1) // size
        tables, slots, taken = [], [], 0
        for _ in range(batch):
            table = [SCRATCH_BLOCK] * first + [1 + (taken + i) % usable for i in range(context // size + 1 - first)]
            taken += len(table) - first
            tables.append(table)
            slots.append(table[-1] * size + context % size)
        group_slots.append(slots)
        group_tables.append(tables)
    return group_slots, group_tables


def decode_blocks_needed(batch: int, context: int) -> int:
    """KV blocks `load_decode_step` addresses (with the scratch block)."""
    return 1 + batch * blocks_per_seq(context + 1)


def graph_replay_ms(runner, vocab_size: int, batch: int, context: int, iters: int = 30) -> float:
    """Median ms of one replay of the engine's full-decode graph for `batch` (a captured size) at
    `context` cached tokens: the step the engine serves, without the host around it. Overwrites the
    K/V of blocks 1..decode_blocks_needed - 1 and the runner's static buffers."""
    graphs = runner.decode_graphs
    if graphs is None or batch not in graphs.sizes:
        raise ValueError(f"no decode graph for batch {batch} (captured: {graphs.sizes if graphs else ()})")
    load_decode_step(runner, vocab_size, batch, context)
    return median_ms(lambda: graphs.replay(batch, batch), iters=iters)


def run(model: str, batches=None, contexts=None, peers: str | None = None, iters: int = 30,
        time_budget_s: float | None = None, decode_gemv: bool = False,
        quantization: str | None = None) -> Report:
    """peers: "all" (default), "eager" (transformers eager only) or "none".
    decode_gemv: compare the GEMV switch: the first engine runs cuBLAS only (decode_gemv=False) and
    the full_graph_gemv rows come from a second one with it on.
    quantization: "fp8" adds full_graph_fp8 rows (the model quantized in place after the other engines)."""
    from custom_ops import RuntimeMode
    from engine import LLM

    batches = parse_ints(batches, BATCHES)
    contexts = parse_ints(contexts, CONTEXTS)
    peers = peers or "all"
    deadline = Deadline(time_budget_s)
    on_cuda = torch.cuda.is_available()
    ceilings = measure_ceilings() if on_cuda else None
    net = build_model(model)
    cost = model_cost(net)
    report = Report("decode", model, ceilings.device_name if ceilings else "cpu", COLUMNS)
    report.meta.update(weight_bytes=cost.weight_bytes, kv_bytes_per_token=cost.kv_bytes_per_token(),
                       copy_bytes_per_s=ceilings.copy_bytes_per_s if ceilings else None,
                       torch=torch.__version__, batches=batches, contexts=contexts)
    bw = ceilings.copy_bytes_per_s if ceilings else None

    floor_costs = {}  # variant -> the ModelCost its floor reads, where it is not the model's as built

    def add(variant: str, b: int, c: int, ms: float) -> None:
        floor = decode_floor_ms(floor_costs.get(variant, cost), b, c + 1, bw) if bw else None
        report.add(variant=variant, batch=b, context=c, median_ms=ms, floor_ms=floor, x_floor=ratio(ms, floor),
                   tokens_per_s=b / ms * 1e3)

    grid = [(b, c) for c in contexts for b in batches]
    free = torch.cuda.mem_get_info()[0] if on_cuda else 8 << 30
    grid, skipped = _points_that_fit(grid, cost.kv_bytes_per_token(), free)
    if skipped:
        report.notes.append(f"skipped (K/V pool would exceed {KV_MEMORY_FRACTION:.0%} of free memory): "
                            + ", ".join(f"bs{b} ctx{c}" for b, c in skipped))
    max_batch = max(b for b, _ in grid)
    max_context = max(c for _, c in grid)
    num_blocks = max(decode_blocks_needed(b, c) for b, c in grid)
    # compile=True: the engine's default on CUDA only, and the "compiled" rows must be compiled everywhere.
    engine_fields = dict(max_num_seqs=max_batch, max_model_len=max_context + BLOCK_SIZE, num_gpu_blocks=num_blocks,
                         decode_graph_sizes=tuple(sorted({b for b, _ in grid})), show_progress=False,
                         max_num_batched_tokens=max(256, max_batch), compile=True)
    llm = LLM(net, **engine_fields, **({"decode_gemv": False} if decode_gemv else {}))
    runner = llm.runtime.runner
    with torch.inference_mode():  # the engine made the pool in inference mode
        for t in llm.runtime.kv_cache.tensors:
            t.normal_()  # random K/V: never time on zeros
    graphs = (f"engine decode graphs for batches {list(runner.decode_graphs.sizes)}, captured with max_seq_len = "
              f"max_model_len = {max_context + BLOCK_SIZE} (as the engine serves)"
              if runner.decode_graphs is not None else "no decode graphs (the engine captures them on CUDA only)")
    report.notes.append(f"{graphs}; K/V pool {num_blocks} blocks, each sequence its own blocks, random contents")
    if runner.decode_graphs is not None:
        report.notes.append("full_graph rows replay the decode graphs (the compiled pieces recorded with "
                            "attention between them); 'compiled' rows run the pieces without graphs")

    def load(b: int, c: int):
        return load_decode_step(runner, net.config.vocab_size, b, c)

    ours_points = []
    with torch.inference_mode():
        for b, c in grid:
            meta = load(b, c)
            ids, pos = runner.buffers.input_ids[:b], runner.buffers.positions[:b]

            def eager():
                with runner.forward_context(meta, RuntimeMode.NONE, b):
                    return net.compute_logits(net(ids, pos))

            def compiled():
                return net.compute_logits(runner.run_forward(meta, RuntimeMode.NONE, b))

            add("eager", b, c, median_ms(eager, iters=iters))
            add("compiled", b, c, median_ms(compiled, iters=iters))
            if runner.decode_graphs is not None:
                reference = compiled().float()
                error = rel_err(runner.decode_graphs.replay(b, b), reference)
                add("full_graph", b, c, graph_replay_ms(runner, net.config.vocab_size, b, c, iters))
                report.rows[-1]["full_vs_compiled_rel_err"] = error
            ours_points.append((b, c))

        # torch.compile "reduce-overhead" on our model: a fresh Dynamo cache, one compile per batch
        if peers == "all" and on_cuda:
            torch._dynamo.reset()
            step = torch.compile(lambda i, p: net.compute_logits(net(i, p)), mode="reduce-overhead")
            for b, c in COMPILED_PEER_POINTS:
                if (b, c) not in ours_points:
                    continue
                if not deadline.allows(60):
                    report.notes.append(f"ours_reduce_overhead bs{b} ctx{c} skipped: time budget")
                    continue
                meta = load(b, c)
                ids, pos = runner.buffers.input_ids[:b], runner.buffers.positions[:b]

                def reduce_overhead():
                    with runner.forward_context(meta, RuntimeMode.NONE, b):
                        return step(ids, pos)
                try:
                    add("ours_reduce_overhead", b, c, median_ms(reduce_overhead, warmup=5, iters=iters))
                except Exception as exc:  # a peer failing must not lose our rows
                    report.notes.append(f"ours_reduce_overhead bs{b} ctx{c} failed: {type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:200]}")
    report.meta["engine_stats"] = {k: v for k, v in llm.stats().items() if k != "backend"}
    has_graphs = runner.decode_graphs is not None
    llm.runtime.kv_cache.release()
    del llm, runner
    torch._dynamo.reset()
    free_device_memory()
    second_engines = []
    if decode_gemv:
        second_engines.append(("full_graph_gemv", {"decode_gemv": True}))
        report.notes.append("full_graph rows: an engine with EngineConfig.decode_gemv=False (cuBLAS only); "
                            "full_graph_gemv rows: a second engine over the same model with decode_gemv=True, the "
                            "default (custom_ops/gemv_table.py: the Triton GEMV at batch 1 for the measured shapes)")
    if quantization:
        from models import QUANTIZATIONS, quantize_fp8
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"decode: quantization {quantization!r} is not one of {QUANTIZATIONS}")
        second_engines.append((f"full_graph_{quantization}", {"quantization": quantization}))
    for variant, overrides in second_engines:
        if "quantization" in overrides:
            quantize_fp8(net)  # in place, once the engines over the model as built are closed
            floor_costs[variant] = model_cost(net)
            report.meta["fp8_weight_bytes"] = floor_costs[variant].weight_bytes
            report.notes.append(f"{variant} rows: one more engine over the same model quantized to FP8 "
                                f"(EngineConfig.quantization): {floor_costs[variant].weight_bytes / 1e9:.3f} GB of "
                                f"weights against {cost.weight_bytes / 1e9:.3f}, its floor_ms from those bytes")
        if not has_graphs:
            report.notes.append(f"{variant}: no decode graphs on this device, nothing to time")
        elif not deadline.allows(60):
            report.notes.append(f"{variant} skipped: time budget")
        else:
            _add_engine_rows(report, net, {**engine_fields, **overrides}, variant, ours_points, add, iters)
            torch._dynamo.reset()
            free_device_memory()
    del net

    if peers in ("all", "eager"):
        _run_hf_peers(report, model, add, peers, deadline, iters, contexts, batches)
    report.plots.append(("latency", plot_decode))
    return report


def _add_engine_rows(report: Report, net, engine_fields: dict, variant: str, points, add, iters: int) -> None:
    """`variant` rows: the decode graphs of one more engine (engine_fields) over the same model,
    replayed at the same points; `vs_cublas_eager_rel_err` compares its logits with the same step run
    eager on cuBLAS (what the GEMV's rounding changes, when the engine has it on)."""
    from custom_ops import RuntimeMode
    from engine import LLM
    from models import set_decode_gemv

    gemv = engine_fields.get("decode_gemv", True)
    llm = LLM(net, **engine_fields)
    try:
        runner, vocab = llm.runtime.runner, net.config.vocab_size
        with torch.inference_mode():
            for t in llm.runtime.kv_cache.tensors:
                t.normal_()
            for b, c in points:
                meta = load_decode_step(runner, vocab, b, c)
                logits = runner.decode_graphs.replay(b, b).float()
                set_decode_gemv(net, False)  # eager calls only: the graphs recorded their kernels
                try:
                    with runner.forward_context(meta, RuntimeMode.NONE, b):
                        reference = net.compute_logits(net(runner.buffers.input_ids[:b], runner.buffers.positions[:b]))
                finally:
                    set_decode_gemv(net, gemv)
                add(variant, b, c, graph_replay_ms(runner, vocab, b, c, iters))
                report.rows[-1]["vs_cublas_eager_rel_err"] = rel_err(logits, reference)
    finally:
        llm.close()


def _run_hf_peers(report: Report, model: str, add, peers: str, deadline: Deadline, iters: int,
                  contexts, batches) -> None:
    from bench import hf_peers
    hf = hf_peers.hf_model(load_config(model), device="cuda" if torch.cuda.is_available() else "cpu",
                           dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    points = [(b, c) for b, c in PEER_POINTS if c in contexts and b in batches]
    compiled_points = []
    if peers == "all" and torch.cuda.is_available():
        compiled_points = [(b, c) for b, c in COMPILED_PEER_POINTS if c in contexts and b in batches]
    with torch.no_grad():
        for b, c in points:
            if not deadline.allows(30):
                report.notes.append(f"hf_eager bs{b} ctx{c} skipped: time budget")
                continue
            add("hf_eager", b, c, hf_peers.decode_eager_generate_ms(hf, b, c, **EAGER_GENERATE_LENGTHS))
            free_device_memory()
        for b, c in compiled_points:
            if not deadline.allows(80):
                report.notes.append(f"hf_static_compiled bs{b} ctx{c} skipped: time budget")
                continue
            torch._dynamo.reset()
            try:
                add("hf_static_compiled", b, c, hf_peers.decode_static_generate_ms(hf, b, c))
            except Exception as exc:  # a peer failing must not lose our rows
                report.notes.append(f"hf_static_compiled bs{b} ctx{c} failed: {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:200]}")
                logger.exception("hf_static_compiled failed")
            free_device_memory()
    report.notes.append(peer_note(points, compiled_points))
    del hf
    torch._dynamo.reset()
    free_device_memory()


def peer_note(eager_points, compiled_points) -> str:
    """Where the peers were run: only points attempted (a skip or a failure has its own note), so the
    report never names a compiled peer that this run did not measure."""
    def where(points):
        return ", ".join(f"bs{b} ctx{c}" for b, c in points) or "no point of this grid"
    note = f"peers on a reduced grid to keep the run short: hf_eager at {where(eager_points)}"
    if compiled_points:
        note += (f"; hf_static_compiled and ours_reduce_overhead at {where(compiled_points)} "
                 "(each point one compile)")
    return note


def plot_decode(report: Report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    contexts = sorted({r["context"] for r in report.rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.2), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        plot_latency_vs_floor(ax, [r for r in report.rows if r["context"] == c], "batch", "batch size",
                              "ms per decode step", f"{report.model}, context {c}")
    return fig
