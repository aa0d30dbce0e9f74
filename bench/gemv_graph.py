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

`--batches B` (2-64): the decode graph of B rows, and the 2-64-row table's bucket for B rows (skinny
GEMM tiles, cuBLASLt or cuBLAS's default per shape) over every matmul of the model: the bucket's
entries were picked by timing each call alone (`bench gemm`), and a verify step of 1 + k tokens runs
them (B = 5 for k = 4).

`--tp-size N`: the graph of one rank of N-way tensor parallelism, on one GPU: a model of one rank's
shapes (bench.gemm.rank_config: heads, intermediate size and vocabulary split), so without the
collectives. None of those shapes is in the table (every one runs cuBLAS, and the GEMV + rotary and
gated GEMV fusions are off for want of a GEMV entry), so every linear shape is swept against cuBLAS as
its entry; a pick also turns those fusions on for its shape.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from bench.common import device_and_dtype, parse_ints
from bench.configs import load_config
from bench.gemm import rank_config
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


# FP8 weights (--quantization fp8): one byte a value, so a K tile of the bf16 tables' width loads half
# the bytes; these add the wider K tiles that load as much as the bf16 ones do.
FP8_CANDIDATES = CANDIDATES + tuple(GemvConfig(block_n=n, block_k=k, split_k=s, num_warps=w) for n, k, s, w in (
    (2, 2048, 1, 4), (4, 2048, 1, 4), (8, 2048, 1, 4), (8, 1024, 2, 4), (16, 1024, 2, 4), (4, 2048, 1, 8),
    (8, 2048, 1, 8), (8, 1024, 1, 8), (32, 1024, 1, 8)))


def candidates(shape: tuple[int, int], entry: GemvConfig | None, pool: tuple[GemvConfig, ...] = CANDIDATES
               ) -> list[GemvConfig]:
    """The configs to try for `shape` (N, K): every candidate but the entry itself, without those whose
    splits would each get less than a quarter of one K tile's worth of work."""
    k = shape[1]
    return [c for c in pool if c != entry and c.block_k * c.split_k <= 4 * k]


def label(choice: GemvConfig | str | None) -> str:
    """A table choice's name: a Triton config's label, "cublaslt", or "cublas" (None: cuBLAS's default)."""
    return choice.label() if isinstance(choice, GemvConfig) else (choice or "cublas")


class GemvTable:
    """The one-row GEMV entries of a table (shape -> config; no entry: cuBLAS) as the sweep edits them."""

    def __init__(self, table: dict) -> None:
        self.table, self.saved = table, dict(table)

    def entry(self, shape: tuple[int, int]) -> GemvConfig | None:
        return self.table.get(shape)

    def set(self, shape: tuple[int, int], choice: GemvConfig | None) -> None:
        if choice is None:
            self.table.pop(shape, None)
        else:
            self.table[shape] = choice

    def restore(self, shape: tuple[int, int]) -> None:
        self.set(shape, self.saved.get(shape))


class SkinnyTable:
    """One row bucket of the 2-64-row table (shape -> {bucket: config or CUBLASLT}; none: cuBLAS's default)
    as the sweep edits it: the bucket a decode graph of `rows` rows reads (custom_ops.gemv_table.gemv_config)."""

    def __init__(self, table: dict, rows: int) -> None:
        self.table = table
        self.bucket = next(b for b in gemv_table.ROW_BUCKETS if rows <= b)
        self.saved = {shape: dict(choices) for shape, choices in table.items()}

    def entry(self, shape: tuple[int, int]) -> GemvConfig | str | None:
        return self.table.get(shape, {}).get(self.bucket)

    def set(self, shape: tuple[int, int], choice: GemvConfig | str | None) -> None:
        choices = self.table.setdefault(shape, {})
        if choice is None:
            choices.pop(self.bucket, None)
        else:
            choices[self.bucket] = choice
        if not choices and shape not in self.saved:
            del self.table[shape]

    def restore(self, shape: tuple[int, int]) -> None:
        self.set(shape, self.saved.get(shape, {}).get(self.bucket))


class Fp8Table:
    """The FP8 GEMV entries as the sweep edits them: a shape's entry is the config the engine runs now
    (custom_ops.gemv_table.fp8_config: FP8_GEMV_CONFIGS, else the bf16 table's entry, else the
    default); setting one sets FP8_GEMV_CONFIGS; restoring puts back what was there."""

    def __init__(self, shapes: list[tuple[int, int]], capability: tuple[int, int] | None = None) -> None:
        self.shapes, self.capability = shapes, capability
        self.saved = dict(gemv_table.FP8_GEMV_CONFIGS)

    def __contains__(self, shape) -> bool:
        return shape in self.shapes

    def entry(self, shape: tuple[int, int]) -> GemvConfig:
        return gemv_table.fp8_config(1, *shape, torch.bfloat16, "cuda", capability=self.capability)

    def set(self, shape: tuple[int, int], config: GemvConfig) -> None:
        gemv_table.FP8_GEMV_CONFIGS[shape] = config

    def restore(self, shape: tuple[int, int]) -> None:
        gemv_table.FP8_GEMV_CONFIGS.pop(shape, None)
        if shape in self.saved:
            gemv_table.FP8_GEMV_CONFIGS[shape] = self.saved[shape]


class Fp8SkinnyTable:
    """The FP8 skinny GEMM's bucket for `rows` rows as the sweep edits it: a shape's entry is the config
    the engine runs now (custom_ops.gemv_table.fp8_config: FP8_SKINNY_CONFIGS, else the bf16 table's
    tile, else the default); setting one sets FP8_SKINNY_CONFIGS; restoring puts back what was there."""

    def __init__(self, rows: int, capability: tuple[int, int] | None = None) -> None:
        self.rows, self.capability = rows, capability
        self.bucket = next(b for b in gemv_table.ROW_BUCKETS if rows <= b)
        self.saved = {shape: dict(choices) for shape, choices in gemv_table.FP8_SKINNY_CONFIGS.items()}

    def entry(self, shape: tuple[int, int]) -> GemvConfig:
        return gemv_table.fp8_config(self.rows, *shape, torch.bfloat16, "cuda", capability=self.capability)

    def set(self, shape: tuple[int, int], config: GemvConfig) -> None:
        gemv_table.FP8_SKINNY_CONFIGS.setdefault(shape, {})[self.bucket] = config

    def restore(self, shape: tuple[int, int]) -> None:
        gemv_table.FP8_SKINNY_CONFIGS.pop(shape, None)
        if shape in self.saved:
            gemv_table.FP8_SKINNY_CONFIGS[shape] = dict(self.saved[shape])


def fp8_skinny_candidates(shape: tuple[int, int], entry: GemvConfig) -> list[GemvConfig]:
    """At 2-64 rows with FP8 weights: the bf16 candidates, and 256-wide K tiles, which load as many bytes
    a row as the bf16 tables' 128-wide ones (the FP8 kernel has no cuBLAS alternative)."""
    from bench.gemm import skinny_configs
    wide = tuple(GemvConfig(block_n=n, block_k=256, split_k=split, num_warps=4, num_stages=4)
                 for n in (16, 32, 64, 128) for split in (1, 2))
    return [c for c in (*skinny_configs(*shape), *wide) if c != entry]


def skinny_candidates(shape: tuple[int, int], entry: GemvConfig | str | None) -> list[GemvConfig | str | None]:
    """At 2-64 rows: the skinny GEMM's candidates of `bench gemm` (bench.gemm.skinny_configs), cuBLASLt
    and cuBLAS's default, but the entry itself."""
    from bench.gemm import skinny_configs
    return [c for c in (*skinny_configs(*shape), gemv_table.CUBLASLT, None) if c != entry]


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


def device_tables() -> gemv_table.TunedTables:
    """The tables the engine reads on this GPU (its compute capability's), which the sweep edits in
    place; an error where the capability has none, since the sweep re-picks an existing table's entries."""
    capability = gemv_table.device_capability()
    if capability not in gemv_table.TABLES:
        raise RuntimeError(f"gemv_graph: compute capability {capability[0]}.{capability[1]} has no table in "
                           "custom_ops.gemv_table.TABLES; the sweep re-picks an existing table's entries, so add "
                           "one first (another capability's entries are a starting point)")
    return gemv_table.TABLES[capability]


def model_shapes(model: torch.nn.Module, table: dict | None = None) -> list[tuple[int, int]]:
    """The table's shapes (default: the sm_90 table) among the model's 2-D weights, in the order the
    model holds them; table=False: every matmul's shape (its linear layers' and the LM head's), in the
    table or not."""
    table = gemv_table.GEMV_CONFIGS if table is None else table
    if table is False:
        from models import matmul_weights
        weights = matmul_weights(model)
    else:
        weights = [getattr(m, "weight", None) for m in model.modules()]
    shapes: list[tuple[int, int]] = []
    for weight in weights:
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            shape = tuple(weight.shape)
            if (table is False or shape in table) and shape not in shapes:
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
        quantization: str | None = None, tp_size: int | None = None, batches=None, **_: object) -> Report:
    """candidate_set: "tiles" (CANDIDATES, the tile shapes; FP8_CANDIDATES with FP8 weights),
    "neighbours" (each entry's tile with other stages and warps) or "whole_k" (whole_k).
    quantization "fp8": the engine's linears in FP8, and the sweep edits the FP8 GEMV entries
    (custom_ops.gemv_table.FP8_GEMV_CONFIGS), starting from the configs the engine runs now.
    tp_size N > 1: one rank's graph (the module docstring); bf16 only.
    batches: the decode graph's rows (the first value; default 1). Above one row the sweep edits the
    2-64-row table's bucket for that many rows (SkinnyTable; with FP8 weights Fp8SkinnyTable) in the
    decode graph of that batch, over every matmul of the model, with skinny_candidates
    (fp8_skinny_candidates; "tiles" only): a verify step of 1 + k tokens runs the bucket of 1 + k rows."""
    if not torch.cuda.is_available():
        raise RuntimeError("the gemv_graph suite needs a CUDA device: it times decode graph replays")
    from bench.decode import graph_replay_ms
    from engine import LLM

    if candidate_set not in CANDIDATE_SETS:
        raise ValueError(f"gemv_graph: candidate_set {candidate_set!r} is not one of {CANDIDATE_SETS}")
    import models
    context = parse_ints(contexts, (CONTEXT,))[0]
    batch = parse_ints(batches, (1,))[0]
    budget = TIME_BUDGET_S if time_budget_s is None else time_budget_s
    tp_size = tp_size or 1
    fp8 = quantization == "fp8"
    if fp8 and tp_size > 1:
        raise ValueError("gemv_graph: --tp-size sweeps the bf16 table's shapes of one rank; not with --quantization fp8")
    if batch > 1 and (candidate_set != "tiles" or batch > gemv_table.ROW_BUCKETS[-1]):
        raise ValueError(f"gemv_graph: --batches {batch} sweeps the 2-{gemv_table.ROW_BUCKETS[-1]}-row table with "
                         "--candidates tiles only")
    tables = device_tables()  # before the engine: a GPU without a table has nothing to sweep
    device, dtype = device_and_dtype()
    net = models.from_config(rank_config(load_config(model), tp_size), dtype=dtype, device=device, seed=0)
    shapes = model_shapes(net, tables.gemv if tp_size == 1 and batch == 1 else False)
    table = SkinnyTable(tables.skinny, batch) if batch > 1 else GemvTable(tables.gemv)
    llm = LLM(net, max_num_seqs=batch, max_model_len=context + 64, prefill_graphs=False, show_progress=False,
              decode_graph_sizes=(batch,), quantization=quantization)
    if fp8:  # the FP8 layers' shapes (the LM head and the embedding keep their dtype and bf16 entries)
        from custom_ops.fp8 import FP8_DTYPE
        fp8_shapes = {tuple(m.weight.shape) for m in net.modules()
                      if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dtype == FP8_DTYPE}
        shapes = [shape for shape in shapes if shape in fp8_shapes]
        table = Fp8Table(shapes) if batch == 1 else Fp8SkinnyTable(batch)
    runner = llm.runtime.runner

    def replay_ms() -> float:
        with torch.inference_mode():  # the engine made its pool and buffers in inference mode
            runner.decode_graphs.capture((batch,), False)
            return graph_replay_ms(runner, net.config.vocab_size, batch, context, ITERS)

    report = Report("gemv_graph", model, torch.cuda.get_device_name(), COLUMNS)
    report.meta.update(torch=torch.__version__, context=context, iters=ITERS, candidate_set=candidate_set,
                       quantization=quantization, tp_size=tp_size, batch=batch,
                       bucket=getattr(table, "bucket", None))
    rows: list[dict] = []
    start = time.perf_counter()
    skipped = 0
    try:
        base_ms = [replay_ms()]
        for shape in shapes:
            entry = table.entry(shape)  # None: no entry, cuBLAS
            pool = FP8_CANDIDATES if fp8 else CANDIDATES
            if not isinstance(entry, GemvConfig) and candidate_set != "tiles":
                report.notes.append(f"{shape[0]}x{shape[1]}: no tile to take the {candidate_set} of ({label(entry)}); skipped")
                continue
            if batch > 1:
                tried = fp8_skinny_candidates(shape, entry) if fp8 else skinny_candidates(shape, entry)
            else:
                tried = {"tiles": lambda: candidates(shape, entry, pool), "neighbours": lambda: neighbours(entry),
                         "whole_k": lambda: whole_k(shape, entry)}[candidate_set]()
            for config in tried:
                if time.perf_counter() - start > budget:
                    skipped += 1
                    continue
                table.set(shape, config)
                try:
                    ms = replay_ms()
                finally:
                    table.restore(shape)
                rows.append(dict(shape=shape, config=label(config), replay_ms=ms, table_entry=label(entry),
                                 candidate=config))
            base_ms.append(replay_ms())  # the entry restored: the run's drift and noise
        base = sorted(base_ms)[len(base_ms) // 2]
        for row in rows:
            row["delta_us"] = (row["replay_ms"] - base) * 1e3
        chosen = picks(rows, base_ms)
        if chosen:  # every pick at once: the step they give together (picks were timed one at a time)
            for shape, row in chosen.items():
                table.set(shape, row["candidate"])
            try:
                report.meta["all_picks_ms"] = [replay_ms() for _ in range(3)]
            finally:
                for shape in chosen:
                    table.restore(shape)
    finally:
        llm.close()
    report.meta.update(base_ms=base_ms, picks={f"{n}x{k}": r["config"] for (n, k), r in chosen.items()},
                       pick_configs={f"{n}x{k}": dataclasses.asdict(r["candidate"]) if isinstance(r["candidate"], GemvConfig)
                                     else label(r["candidate"]) for (n, k), r in chosen.items()})
    for row in rows:
        row["pick"] = "pick" if chosen.get(row["shape"]) is row else ""
        row["shape"] = f"{row['shape'][0]}x{row['shape'][1]}"
        del row["candidate"]
        report.add(**row)
    if "all_picks_ms" in report.meta:
        report.notes.append(f"every pick at once: replays of {', '.join(f'{ms:.4f}' for ms in report.meta['all_picks_ms'])}"
                            f" ms against the base's median {base:.4f} ms")
    if tp_size > 1:
        report.notes.append(f"one rank of {tp_size}-way tensor parallelism on one GPU (bench.gemm.rank_config): its "
                            "shapes, without the collectives; a shape with no entry runs cuBLAS, its row's "
                            "table_entry says 'cublas'")
    report.notes.append(f"batch-{batch} decode graph at {context} cached tokens, re-captured per candidate; median of "
                        f"{ITERS} replays; delta against the median base replay {base:.4f} ms (base timed "
                        f"{len(base_ms)} times: {min(base_ms):.4f}-{max(base_ms):.4f} ms)")
    if skipped:
        report.notes.append(f"{skipped} candidates skipped after the {budget:.0f} s time budget")
    return report
