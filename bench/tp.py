"""Suite `tp`: engine step latency with the model split over 1 and 2 GPUs (tensor parallelism).

Workloads, each through the engine's own API (LLM.step: schedule, staged-step broadcast, forward,
sampling on rank 0), graphs on (decode graphs for the decode batches, piecewise graphs for the
prefill size):
  decode bs B   B requests with a `context`-token prompt each (512), all decoding: median of the steps;
  prefill T     one fresh T-token prompt (max_tokens=1): median of the steps.
Weights are random (they time like real ones) but must come from a checkpoint, because every rank
loads its own shards: the suite writes one per model once (a cache dir, INFER_BENCH_CACHE).

Floor per GPU = the suite decode/prefill floors of the rank's shard (its weight bytes and K/V bytes
over the measured copy bandwidth; prefill: or its FLOPs over the matmul rate) + the number of
collectives in one forward (one all-reduce per row-parallel projection and one for the embedding,
one all-gather of the logits) x their latency, measured here with NCCL inside a CUDA graph (as the
engine replays them) at the step's token count.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import device_and_dtype, free_device_memory, parse_ints
from bench.configs import load_config
from bench.floors import decode_floor_ms, model_cost, prefill_floor_ms
from bench.measure import Report, measure_ceilings, ratio

logger = logging.getLogger("bench")

BATCHES = (1, 32)
CONTEXT = 512
PREFILL_TOKENS = (512,)
TP_SIZES = (1, 2)
COLUMNS = ["tp", "all_reduce", "workload", "median_ms", "floor_ms", "x_floor", "vs_tp1", "weight_gb_per_gpu",
           "collectives", "all_reduce_us", "all_reduce_kind", "nccl_all_reduce_us", "collective_us"]
SWEEP_TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)


def random_checkpoint(name: str, seed: int = 0) -> str:
    """An HF-format dir with random weights for a benchmark model, written once (bf16 on CUDA)."""
    import models
    from models.loader import weight_slots
    from safetensors.torch import save_file
    device, dtype = device_and_dtype()
    root = Path(os.environ.get("INFER_BENCH_CACHE", Path.home() / ".cache" / "infer_graphs" / "bench"))
    target = root / f"{name}-random-{seed}-{str(dtype).removeprefix('torch.')}"
    if (target / "model.safetensors").is_file():
        return str(target)
    config = dict(load_config(name), torch_dtype=str(dtype).removeprefix("torch."))
    model = models.from_config(config, dtype=dtype, device=device, seed=seed)
    tensors = {key: slot.target.detach().to("cpu").contiguous() for key, slot in weight_slots(model).items()}
    del model
    free_device_memory()
    target.mkdir(parents=True, exist_ok=True)
    tmp = target / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    (target / "config.json").write_text(json.dumps(config))
    tmp.rename(target / "model.safetensors")  # last: a half-written dir is never taken for a checkpoint
    return str(target)


def _collective_rank(rank: int, world: int, port: int, shapes: list[tuple[int, int, int, int]], out) -> None:
    """Per shape (tokens, hidden, gathered rows, columns): microseconds of one all-reduce of
    [tokens, hidden] by each kernel (NCCL, symmetric-memory one-shot and two-shot: None where the
    kernel refuses the size), the engine's choice among them, and one NCCL all-gather of [rows,
    columns]; each the median over replays of a CUDA graph of 20 calls (as the engine replays them)."""
    import datetime
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol
    from custom_ops import all_reduce
    from engine.distributed.rank_loop import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    largest = max(tokens * hidden for tokens, hidden, _, _ in shapes) * 2
    symm = all_reduce.SymmetricAllReduce.create(group, torch.device("cuda", rank), largest, largest)
    # the engine's thresholds over the same buffer (every shape here fits it, so its size decides nothing)
    engine_choice = (all_reduce.SymmetricAllReduce(group, symm.buffer, ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES)
                     if symm is not None else None)

    def waited(t: torch.Tensor) -> torch.Tensor:
        return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t

    def graph_us(op, reps: int = 20) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up on the capture stream
            for _ in range(3):
                op()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                op()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / reps)
        del graph
        return statistics.median(samples)

    results = []
    for tokens, hidden, rows, cols in shapes:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda")
        row = {"nccl": graph_us(lambda: waited(funcol.all_reduce(x, "sum", group))),
               "all_gather": graph_us(lambda: waited(gather(y, 0, group)))}
        for kind in (all_reduce.ONE_SHOT, all_reduce.TWO_SHOT):
            row[kind] = graph_us(lambda: symm.run(x, kind)) if symm is not None and symm.accepts(x, kind) else None
        row["engine_kind"] = engine_choice.kind(x) if engine_choice is not None else all_reduce.NCCL
        row["engine"] = row[row["engine_kind"]]
        results.append(row)
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives_us(world: int, shapes: list[tuple[int, int, int, int]]) -> list[dict]:
    """Per shape, microseconds of each all-reduce kernel and of the all-gather (_collective_rank),
    over `world` GPUs (spawned processes)."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_rank, args=(r, world, port, shapes, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()


def _time_steps(llm, prompts: list[list[int]], max_tokens: int, keep) -> list[float]:
    """Milliseconds of each engine step that `keep()` (asked after the step) accepts; host wall
    time: each step ends with the sampler's copy to the host, so it includes the GPU work."""
    from engine import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        llm.add_request(prompt, params)
    times = []
    while llm.has_unfinished_requests():
        start = time.perf_counter()
        llm.step()
        ms = (time.perf_counter() - start) * 1e3
        if keep():
            times.append(ms)
    return times


def _decode_tokens(batch: int, context: int, budget: int, iters: int) -> int:
    """max_tokens per decode request: the prefill steps (decodes share the token budget, so up to
    twice ceil(batch * context / budget)), then at least `iters` steps with the whole batch decoding."""
    return 2 * -(-batch * context // budget) + 2 + iters


def _workloads(llm, batches, tokens, context: int, vocab: int, iters: int) -> dict[str, float]:
    """Median step ms per workload name."""
    gen = torch.Generator().manual_seed(0)
    graphs = llm.runtime.runner.decode_graphs

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    results = {}
    for b in batches:
        max_tokens = _decode_tokens(b, context, llm.config.max_num_batched_tokens, iters)
        if graphs is not None:  # exactly the steps that replayed the batch-b decode graph
            seen = [graphs.replays_by_size[b]]

            def keep() -> bool:
                replayed, seen[0] = graphs.replays_by_size[b] > seen[0], graphs.replays_by_size[b]
                return replayed
        else:  # CPU: the steps after the prefills
            count = [0]

            def keep() -> bool:
                count[0] += 1
                return count[0] > max_tokens - iters
        times = _time_steps(llm, [prompt(context) for _ in range(b)], max_tokens, keep)
        results[f"decode bs{b} ctx{context}"] = statistics.median(times[:iters])
    for t in tokens:
        times = [_time_steps(llm, [prompt(t)], 1, lambda: True)[0] for _ in range(iters)]
        results[f"prefill {t}"] = statistics.median(times[2:] or times)  # fresh prompts: no prefix hits
    return results


def run(model: str, batches=None, tokens=None, iters: int = 20, tp_sizes=TP_SIZES, context: int = CONTEXT,
        contexts=None, all_reduce: str = "custom", **_: object) -> Report:
    """`contexts` (the command line's --contexts): its first value is the decode context;
    `all_reduce`: custom, nccl or both (the engines with tp > 1 that run)."""
    from engine import LLM
    context = parse_ints(contexts, (context,))[0]
    batches = parse_ints(batches, BATCHES)
    tokens = parse_ints(tokens, PREFILL_TOKENS)
    on_cuda = torch.cuda.is_available()
    ceilings = measure_ceilings() if on_cuda else None
    report = Report("tp", model, ceilings.device_name if ceilings else "cpu", COLUMNS)
    path = random_checkpoint(model)
    config = load_config(model)
    sizes = [n for n in parse_ints(tp_sizes, TP_SIZES) if not on_cuda or n <= torch.cuda.device_count()]
    skipped = [n for n in parse_ints(tp_sizes, TP_SIZES) if n not in sizes]
    if skipped:
        report.notes.append(f"tp {skipped} skipped: {torch.cuda.device_count()} GPU(s) visible")
    max_batch, max_tokens = max(batches), max(tokens)
    budget = max(max_tokens, max_batch)
    engine_args = dict(max_num_seqs=max_batch, max_num_batched_tokens=budget,
                       max_model_len=context + _decode_tokens(max_batch, context, budget, iters) + 8,
                       decode_graph_sizes=tuple(batches),
                       show_progress=False)
    if on_cuda:
        engine_args.update(prefill_graphs=True, prefill_graph_sizes=tuple(tokens), kv_memory_fraction=0.5)
    else:
        engine_args.update(device="cpu")
    report.meta.update(torch=torch.__version__, engine_args={k: v for k, v in engine_args.items()},
                       copy_bytes_per_s=ceilings.copy_bytes_per_s if ceilings else None,
                       matmul_flops_per_s=ceilings.matmul_flops_per_s if ceilings else None)
    kinds = {"custom": ["custom"], "nccl": ["nccl"], "both": ["custom", "nccl"]}[all_reduce]
    runs = [(n, kind) for n in sizes for kind in (kinds if n > 1 else ["-"])]
    baseline: dict[str, float] = {}
    collectives_by_tp: dict[int, list[dict]] = {}
    for n, kind in runs:
        llm = LLM(path, tensor_parallel_size=n, disable_custom_all_reduce=kind == "nccl", **engine_args)
        try:
            shard = model_cost(llm.model)
            num_collectives = 1 + sum(1 for m in llm.model.modules() if getattr(m, "input_shard", None))
            llm_vocab_rows = llm.model.model.embed_tokens.weight.shape[0]
            per_workload = {**{f"decode bs{b} ctx{context}": b for b in batches},
                            **{f"prefill {t}": t for t in tokens}}
            measured = _workloads(llm, batches, tokens, context, config["vocab_size"], iters)
            key = f"engine_stats_tp{n}" + ("_nccl" if kind == "nccl" else "")
            report.meta[key] = {k: v for k, v in llm.stats().items() if k != "backend"}
            untuned = report.meta[key].get("startup", {}).get("gemv_untuned")
            if untuned and kind != "nccl":  # said once per tp size: which of its matmuls ran cuBLAS at batch 1
                report.notes.append(f"tp {n}: {len(untuned)} of rank 0's matmul shapes have no GEMV tuning and ran "
                                    f"cuBLAS at batch 1 ({', '.join(untuned)}; bench gemv_graph --tp-size {n})")
        finally:
            llm.close()
            del llm
            free_device_memory()
        if n > 1 and on_cuda and n not in collectives_by_tp:
            # the logits all-gather moves only the sampled rows: one per decode sequence, one per prefill
            shapes = [(t, config["hidden_size"], t if name.startswith("decode") else 1, llm_vocab_rows)
                      for name, t in per_workload.items()]
            shapes += [(t, config["hidden_size"], 1, llm_vocab_rows) for t in SWEEP_TOKENS]
            collectives_by_tp[n] = measure_collectives_us(n, shapes)
            sweep = collectives_by_tp[n][len(per_workload):]
            report.meta[f"all_reduce_sweep_tp{n}"] = [
                {"tokens": t, "bytes": t * config["hidden_size"] * 2,
                 **{k: row[k] for k in ("nccl", "one_shot", "two_shot", "engine_kind")}}
                for t, row in zip(SWEEP_TOKENS, sweep)]
            report.notes.append(f"tp {n} all-reduce of [tokens, {config['hidden_size']}] bf16 in a CUDA graph, us "
                                "(tokens: nccl / one-shot / two-shot -> engine's): " + "; ".join(
                                    f"{t}: {_us(row['nccl'])} / {_us(row['one_shot'])} / {_us(row['two_shot'])}"
                                    f" -> {row['engine_kind']}" for t, row in zip(SWEEP_TOKENS, sweep)))
        by_workload = dict(zip(per_workload, collectives_by_tp.get(n, [])))
        for name, ms in measured.items():
            t = per_workload[name]
            row = by_workload.get(name)
            ar_us = None
            if row is not None:
                ar_us = row["nccl"] if kind == "nccl" else row["engine"]
            collective_us = num_collectives * ar_us + row["all_gather"] if row is not None else None
            floor = None
            if ceilings is not None:
                if name.startswith("decode"):
                    floor = decode_floor_ms(shard, t, context + 1, ceilings.copy_bytes_per_s)
                else:
                    floor = prefill_floor_ms(shard, t, ceilings.copy_bytes_per_s, ceilings.matmul_flops_per_s)
                floor += (collective_us or 0.0) / 1e3
            if n == sizes[0]:
                baseline[name] = ms
            report.add(tp=n, all_reduce=kind, workload=name, median_ms=ms, floor_ms=floor, x_floor=ratio(ms, floor),
                       vs_tp1=ratio(ms, baseline.get(name)) if n > 1 else None,
                       weight_gb_per_gpu=shard.weight_bytes / 1e9,
                       collectives=num_collectives if n > 1 else 0, all_reduce_us=ar_us,
                       all_reduce_kind=(row["engine_kind"] if kind == "custom" else "nccl") if row else None,
                       nccl_all_reduce_us=row["nccl"] if row else None, collective_us=collective_us)
    report.notes.append(
        "times are engine steps (LLM.step: scheduling, the staged-step broadcast, forward, sampling) with "
        "decode and piecewise graphs on; floor = the rank's weight (+ K/V) bytes / copy bandwidth (prefill: "
        "or FLOPs / matmul rate) + collectives x their latency measured in a CUDA graph (the kernel the "
        "engine picks at that size; all_reduce nccl: NCCL's); vs_tp1 = time / the tp 1 time of the same "
        "workload")
    if not on_cuda:
        report.notes.append("CPU: gloo ranks, no graphs, no floors (a smoke run, not a measurement)")
    return report


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
