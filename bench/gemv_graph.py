"""Suite `gemv_graph`: each batch-1 GEMV shape's config, chosen by what it costs the whole decode step.

The table's entries (custom_ops.gemv_table) were picked by timing each GEMV call alone (suite `gemm`).
In the decode graph a GEMV starts under programmatic dependent launch while the kernel before it
finishes, and the kernel after it waits on it, so a call timed alone is not its cost to the step: on
an H100 (bench/results/h100x2-2026-11-26/gemv-in-graph/), llama-3.2-3b's gate_up entry cost the step
~80 us more than other tiles that were as fast or slower alone.

Here one engine holds the batch-1 decode graph. For each of the model's table shapes and each
candidate config, the table entry is swapped, the graph re-captured, and its median replay at
`context` cached tokens timed; the entry is then restored. The base (the table as it is) is timed
before the first shape and after each one: its spread is the run's noise. A candidate is the
shape's pick when it beats the entry by more than twice that spread (and at least 1 us), and the
picks are what to write into the table (after the GEMV and engine GPU tests pass with them: a
config changes the matmul's summation order). `--candidates neighbours` is the second pass: each
entry's own tile with other pipeline stages and warp counts; `--candidates whole_k` tries tiles whose
one K tile spans the weight's rows (all of a program's weight loaded before the PDL wait).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from bench.common import build_model, parse_ints
from bench.measure import Report
from custom_ops import gemv_table
from custom_ops.gemv_table import GemvConfig

CONTEXT = 576  # the e2e suite's mid-generation context, as the knockout suite
ITERS = 200
TIME_BUDGET_S = 400.0  # candidates past it are skipped (noted in the report)
# --candidates: tile shapes, each entry's stages and warps, or tiles spanning the whole of K
CANDIDATE_SETS = ("tiles", "neighbours", "whole_k")
COLUMNS = ["shape", "config", "replay_ms", "delta_us", "table_entry", "pick"]
CANDIDATES = tuple(GemvConfig(block_n=n, block_k=k, split_k=s, num_warps=w) for n, k, s, w in (
    (4, 512, 1, 4), (8, 256, 1, 4), (8, 512, 1, 4), (8, 1024, 1, 4), (16, 256, 1, 4), (16, 512, 1, 4),
    (32, 256, 1, 4), (8, 512, 2, 4), (16, 256, 2, 4), (16, 512, 2, 4), (16, 256, 4, 4), (8, 512, 4, 4),
    (32, 256, 4, 4), (16, 256, 8, 4), (8, 512, 1, 8), (16, 512, 1, 8), (4, 1024, 1, 4), (16, 1024, 1, 4),
    (32, 512, 1, 4)))


def candidates(shape: tuple[int, int], entry: GemvConfig) -> list[GemvConfig]:
    """The configs to try for `shape` (N, K): every candidate but the entry itself, without those whose
    splits would each get less than a quarter of one K tile's worth of work."""
    k = shape[1]
    return [c for c in CANDIDATES if c != entry and c.block_k * c.split_k <= 4 * k]


def neighbours(entry: GemvConfig) -> list[GemvConfig]:
    """The entry's own tile with other pipeline depths (1, 2, 4 stages) and warp counts (2, 8): the
    second pass once the tile is chosen (bench/results/h100-2026-11-26/gemv-stages-warps/)."""
    variants = [dataclasses.replace(entry, num_stages=s) for s in (1, 2, 4)]
    variants += [dataclasses.replace(entry, num_warps=w) for w in (2, 8)]
    return [c for c in variants if c != entry]


def whole_k(shape: tuple[int, int], entry: GemvConfig) -> list[GemvConfig]:
    """Tiles of 2 or 4 weight rows whose one K tile spans all of K: a program then loads its whole
    share of the weight before the PDL wait, while the kernel before it finishes (the other tiles
    load only their first K tile there)."""
    from custom_ops.triton_common import next_power_of_2
    block_k = next_power_of_2(shape[1])
    return [GemvConfig(block_n=n, block_k=block_k, split_k=1, num_warps=w) for n in (2, 4) for w in (4, 8)
            if n * block_k // (32 * w) <= 128]  # at most 128 weight elements (64 registers) a thread


def device_table() -> dict[tuple[int, int], gemv_table.GemvConfig]:
    """The GEMV table the engine reads on this GPU (its compute capability's), which the sweep edits in
    place; an error where the capability has none, since the sweep re-picks an existing table's entries."""
    capability = gemv_table.device_capability()
    if capability not in gemv_table.TABLES:
        raise RuntimeError(f"gemv_graph: compute capability {capability[0]}.{capability[1]} has no table in "
                           "custom_ops.gemv_table.TABLES; the sweep re-picks an existing table's entries, so add "
                           "one first (another capability's entries are a starting point)")
    return gemv_table.TABLES[capability].gemv


def model_shapes(model: torch.nn.Module, table: dict | None = None) -> list[tuple[int, int]]:
    """The table's shapes (default: the sm_90 table) among the model's 2-D weights, in the order the
    model holds them."""
    table = gemv_table.GEMV_CONFIGS if table is None else table
    shapes: list[tuple[int, int]] = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            shape = tuple(weight.shape)
            if shape in table and shape not in shapes:
                shapes.append(shape)
    return shapes


def picks(rows: list[dict], base_ms: list[float]) -> dict[tuple[int, int], dict]:
    """Shape -> its fastest candidate row, for the shapes where that beats the table's entry by more
    than the noise (twice the base's spread, at least 1 us)."""
    noise_us = max(1.0, 2.0 * (max(base_ms) - min(base_ms)) * 1e3)
    best: dict[tuple[int, int], dict] = {}
    for row in rows:
        shape = row["shape"]
        if row["delta_us"] < -noise_us and (shape not in best or row["delta_us"] < best[shape]["delta_us"]):
            best[shape] = row
    return best


def run(model: str, contexts=None, time_budget_s: float | None = None, candidate_set: str = "tiles",
        **_: object) -> Report:
    """candidate_set: "tiles" (CANDIDATES, the tile shapes), "neighbours" (each entry's tile with
    other stages and warps) or "whole_k" (whole_k)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the gemv_graph suite needs a CUDA device: it times decode graph replays")
    from bench.decode import graph_replay_ms
    from engine import LLM

    if candidate_set not in CANDIDATE_SETS:
        raise ValueError(f"gemv_graph: candidate_set {candidate_set!r} is not one of {CANDIDATE_SETS}")
    context = parse_ints(contexts, (CONTEXT,))[0]
    budget = TIME_BUDGET_S if time_budget_s is None else time_budget_s
    table = device_table()  # before the engine: a GPU without a table has nothing to sweep
    net = build_model(model)
    llm = LLM(net, max_num_seqs=1, max_model_len=context + 64, prefill_graphs=False, show_progress=False,
              decode_graph_sizes=(1,))
    runner = llm.runtime.runner

    def replay_ms() -> float:
        with torch.inference_mode():  # the engine made its pool and buffers in inference mode
            runner.decode_graphs.capture((1,), False)
            return graph_replay_ms(runner, net.config.vocab_size, 1, context, ITERS)

    report = Report("gemv_graph", model, torch.cuda.get_device_name(), COLUMNS)
    report.meta.update(torch=torch.__version__, context=context, iters=ITERS, candidate_set=candidate_set)
    rows: list[dict] = []
    start = time.perf_counter()
    skipped = 0
    try:
        base_ms = [replay_ms()]
        for shape in model_shapes(net, table):
            entry = table[shape]
            tried = {"tiles": lambda: candidates(shape, entry), "neighbours": lambda: neighbours(entry),
                     "whole_k": lambda: whole_k(shape, entry)}[candidate_set]()
            for config in tried:
                if time.perf_counter() - start > budget:
                    skipped += 1
                    continue
                table[shape] = config
                try:
                    ms = replay_ms()
                finally:
                    table[shape] = entry
                rows.append(dict(shape=shape, config=config.label(), replay_ms=ms, table_entry=entry.label()))
            base_ms.append(replay_ms())  # the entry restored: the run's drift and noise
    finally:
        llm.close()
    base = sorted(base_ms)[len(base_ms) // 2]
    for row in rows:
        row["delta_us"] = (row["replay_ms"] - base) * 1e3
    chosen = picks(rows, base_ms)
    for row in rows:
        row["pick"] = "pick" if chosen.get(row["shape"]) is row else ""
        row["shape"] = f"{row['shape'][0]}x{row['shape'][1]}"
        report.add(**row)
    report.meta.update(base_ms=base_ms, picks={f"{n}x{k}": r["config"] for (n, k), r in chosen.items()})
    report.notes.append(f"batch-1 decode graph at {context} cached tokens, re-captured per candidate; median of "
                        f"{ITERS} replays; delta against the median base replay {base:.4f} ms (base timed "
                        f"{len(base_ms)} times: {min(base_ms):.4f}-{max(base_ms):.4f} ms)")
    if skipped:
        report.notes.append(f"{skipped} candidates skipped after the {budget:.0f} s time budget")
    return report
