"""Suite `capacity`: sequences of a context length that one KV memory budget holds, with one pool (every
layer keeps every block) next to a pool per layer kind (engine.kv.groups: sliding-window blocks go back
once out of the window).

The figures are the allocator's own: the real block pools (engine.kv.block_pool, engine.kv.sliding_pool)
sized as the engine sizes them (engine.kv.groups.blocks_per_group) from the model's config, then
filled with sequences (chunked prefill of max_num_batched_tokens, then one decode token) until one no
longer fits. Nothing runs on a device, so the CPU output is the result. On CUDA the suite also builds
the engine (random weights, no compile, no graphs) with that budget and reports what its
`LLM.stats()["kv_groups"]` says, as a check that the engine sizes its pools the same way.

`python -m bench capacity --model gemma-3-1b [--contexts 4096,32768]`
"""
from __future__ import annotations

import torch

from bench.common import parse_ints
from bench.configs import load_config
from bench.measure import Report
from engine.kv.block_pool import BlockPool
from engine.kv.grouped_pool import GroupedBlockPool, make_block_pool
from engine.kv.groups import KVGroup, blocks_per_group, group_by_window

KV_BUDGET_GIB = 16        # fixed KV memory for every row: about what an 80 GB GPU leaves a 1B model
BLOCK_SIZE = 16           # the engine's default
CHUNK_TOKENS = 1024       # the engine's default max_num_batched_tokens
DTYPE_BYTES = 2           # bfloat16


def layer_windows(config: dict) -> dict[str, int | None]:
    """Each layer's sliding window (None: full attention), as the engine's models register them."""
    import models.config
    parsed = models.config.ModelConfig.from_hf(config)
    return {f"layer{i}": parsed.sliding_window if kind == models.config.SLIDING else None
            for i, kind in enumerate(parsed.layer_types)}


def group_bytes_per_block(config: dict, groups: list[KVGroup]) -> list[int]:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_layer = 2 * config["num_key_value_heads"] * head_dim * BLOCK_SIZE * DTYPE_BYTES  # K and V
    return [per_layer * len(g.layer_names) for g in groups]


def fill(pool: BlockPool | GroupedBlockPool, context: int, chunk: int = CHUNK_TOKENS) -> int:
    """Sequences of `context` tokens the pool holds: each prefills context - 1 tokens in chunks (giving
    back what falls out of the window between chunks, as the scheduler does), then decodes its last."""
    count = 0
    while True:
        request = f"seq{count}"
        computed = min(chunk, context - 1)
        if not pool.admit(request, [], computed):
            return count
        while computed < context:
            pool.release_before(request, computed)
            end = min(computed + chunk, context - 1) if computed < context - 1 else context
            if not pool.grow(request, end):
                pool.free(request)
                return count
            computed = end
        count += 1


def pools(config: dict, context: int, budget_bytes: int, by_kind: bool):
    groups = group_by_window(layer_windows(config), by_kind)
    sizes = group_bytes_per_block(config, groups)
    blocks = blocks_per_group(groups, sizes, budget_bytes, context, BLOCK_SIZE, CHUNK_TOKENS)
    return groups, sizes, blocks, make_block_pool(groups, blocks, BLOCK_SIZE, debug_checks=False)


def run(model: str, contexts: str | None = None, **_: object) -> Report:
    config = load_config(model)
    budget = KV_BUDGET_GIB * 2**30
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (allocator arithmetic)"
    report = Report("capacity", model, device, [
        "context", "kv_budget_gib", "one_pool_seqs", "per_kind_seqs", "gain", "one_pool_mib_per_seq",
        "per_kind_mib_per_seq", "per_kind_blocks", "engine_one_pool_seqs", "engine_per_kind_seqs"])
    for context in parse_ints(contexts, (4096, 32768)):
        row = {"context": context, "kv_budget_gib": KV_BUDGET_GIB}
        for by_kind, key in ((False, "one_pool"), (True, "per_kind")):
            groups, sizes, blocks, pool = pools(config, context, budget, by_kind)
            row[f"{key}_seqs"] = fill(pool, context)
            held = sum(n * s for n, s in zip(blocks, sizes)) / max(row[f"{key}_seqs"], 1)
            row[f"{key}_mib_per_seq"] = held / 2**20  # the budget over the sequences it holds
            if by_kind:
                row["per_kind_blocks"] = " + ".join(f"{n} {g.kind} ({len(g.layer_names)} layers)"
                                                    for n, g in zip(blocks, groups))
        row["gain"] = row["per_kind_seqs"] / max(row["one_pool_seqs"], 1)
        if torch.cuda.is_available():
            row["engine_one_pool_seqs"], row["engine_per_kind_seqs"] = (
                _engine_sequences(model, context, budget, hybrid) for hybrid in (False, True))
        report.add(**row)
    report.notes.append(
        f"KV budget {KV_BUDGET_GIB} GiB of bf16 K/V, blocks of {BLOCK_SIZE} tokens, prefill chunks of "
        f"{CHUNK_TOKENS}; a sequence of `context` tokens prefills context - 1 of them and decodes the last "
        "(max_model_len = context)")
    report.notes.append("one_pool: every layer keeps every block (hybrid_kv_cache=False); per_kind: a pool per "
                        "layer kind, sliding blocks freed out of the window (engine.kv.groups, the default)")
    report.notes.append("engine_* columns (CUDA only): LLM.stats()['kv_groups'] max_len_sequences of the "
                        "engine built with that budget (its binding group)")
    return report


def _engine_sequences(model: str, context: int, budget_bytes: int, hybrid: bool) -> int:
    """What the engine itself reports for this budget: the fewest max_model_len sequences over its groups."""
    from bench.common import build_model, free_device_memory
    from engine import LLM
    net = build_model(model)
    config = load_config(model)
    one_pool_bytes = group_bytes_per_block(config, group_by_window(layer_windows(config), False))[0]
    llm = LLM(net, max_model_len=context, block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK_TOKENS,
              num_gpu_blocks=budget_bytes // one_pool_bytes, compile=False, cuda_graphs=False,
              hybrid_kv_cache=hybrid, show_progress=False)
    try:
        return min(g["max_len_sequences"] for g in llm.stats()["kv_groups"])
    finally:
        llm.close()
        del llm, net
        free_device_memory()
