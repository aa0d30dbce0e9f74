"""Sliding-window layers in their own KV pool (engine.kv.groups, engine.kv.sliding_pool), on the CPU.

A tiny Gemma-3-like model (window 8, two sliding layers and one global layer, blocks of 4 tokens)
generates far past its window; the reference is transformers' greedy generate, one prompt at a time.
The engine runs with chunked prefill, preemption, prefix caching on and off, and both step loops,
with the pool's debug checks on (every step: no write into a shared or published block, every
block in exactly one state).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from custom_ops import SCRATCH_BLOCK
from engine import LLM, SamplingParams
from engine.kv.block_pool import BlockPool
from engine.kv.grouped_pool import GroupedBlockPool
from engine.kv.groups import split_memory
from engine.kv.sliding_pool import SlidingBlockPool
from tests.hf_helpers import random_hf_model

WINDOW, BLOCK = 8, 4
CONFIG = dict(vocab_size=96, max_position_embeddings=128, initializer_range=0.5, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
              sliding_window_pattern=3, final_logit_softcapping=30.0)
SHARED = list(range(10, 34))  # 24 tokens: six blocks that later prompts hit
PROMPTS = [[1, *SHARED, 5, 6], [1, 7, 8, 9], [1, *SHARED, 40, 41, 42, 43, 44, 45], [1, *range(50, 70)]]
MAX_TOKENS = 20
SMALL = dict(device="cpu", block_size=BLOCK, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def debug_checks(monkeypatch):
    monkeypatch.setenv("INFER_GRAPHS_DEBUG_CHECKS", "1")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(model dir, transformers' greedy continuation of each prompt, ignoring EOS)."""
    hf = random_hf_model(transformers.Gemma3TextConfig(**CONFIG), seed=11)
    path = tmp_path_factory.mktemp("gemma_window")
    hf.save_pretrained(path)
    return path, [greedy_without_cache(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]


def greedy_without_cache(hf: transformers.PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a forward over the whole sequence (no KV cache): its
    generate() with a sliding-window cache disagrees with its own uncached forward once the prompt is
    longer than the window (seen here with transformers 5.x), so the uncached forward, the model's
    definition, is the reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(hf(torch.tensor([ids], device=hf.device), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_gemma_generation_with_a_window_pool_equals_transformers(gemma, async_scheduling, prefix_caching):
    path, expected = gemma
    llm = LLM(str(path), **SMALL, async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    pool = llm.runtime.block_pool
    assert isinstance(pool, GroupedBlockPool) and [p.window for p in pool.sliding] == [WINDOW]
    outputs = llm.generate(PROMPTS[:2], PARAMS)
    outputs += llm.generate(PROMPTS[2:], PARAMS)  # the third prompt can hit the first one's blocks
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert [g["kind"] for g in stats["kv_groups"]] == ["full", f"sliding_{WINDOW}"]
    assert [g["num_layers"] for g in stats["kv_groups"]] == [1, 2]
    assert pool.sliding[0].released_blocks > 0  # blocks did go back before their requests finished
    if prefix_caching:
        assert stats["prefix_cache"]["hit_tokens"] > 0
    # everything back: free or cached, in every group
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert pool.sliding[0].num_free_blocks == pool.sliding[0].num_usable_blocks


class _EagerDecodeGraphs:
    """Stands in for engine.worker.decode_graphs.DecodeGraphs where there is no CUDA: a replay runs the
    forward under the metadata a capture at that batch size records (every row real, max_seq_len =
    max_model_len, the static buffers' addresses) and writes the static logits through
    compute_logits(out=), over whatever the step staged: what a CUDA graph replay computes."""

    def __init__(self, runner, sizes: tuple[int, ...]) -> None:
        self.runner, self.sizes = runner, tuple(sorted(sizes))
        self.metas = {b: runner.buffers.metadata(b, b, b, 1, runner.max_model_len, True) for b in sizes}
        self.logits = None
        self.replays, self.padded_replays, self.replays_by_size = 0, 0, {}
        self.capture_seconds, self.graph_bytes = 0.0, 0

    def replay(self, batch_size: int, num_real: int) -> torch.Tensor:
        from custom_ops import RuntimeMode
        hidden = self.runner.run_forward(self.metas[batch_size], RuntimeMode.FULL, batch_size)
        if self.logits is None:
            self.logits = torch.empty(self.runner.buffers.max_seqs, self.runner.model.config.vocab_size,
                                      dtype=hidden.dtype)
        self.runner.model.compute_logits(hidden, out=self.logits[:batch_size])
        self.replays += 1
        self.padded_replays += batch_size > num_real
        return self.logits[:num_real]

    def argmax_keys(self, batch_size: int, num_real: int) -> None:
        return None  # the LM head stores argmax keys only on CUDA (CausalLM.argmax_key_tiles)

    def release(self) -> None:
        self.logits = None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter; on CUDA "
                    "tests/test_sliding_window_kv_gpu.py runs the real decode graphs")
def test_full_decode_steps_with_a_window_pool_run_the_triton_kernels_as_a_graph_replay_would(gemma, monkeypatch):
    """What only a GPU runs otherwise: full-decode steps (padding rows on the scratch block of every
    KV group, each group's slots and tables in its own static buffers) through the Triton kernels (the
    interpreter here): split-K decode and prefill each storing K/V in their own launch, into the
    sliding group's pool by its own slot mapping, v a strided view of the fused projection. Async
    loop, prefix caching, chunked prefill; tokens equal transformers'."""
    from custom_ops import reference, triton_attention
    from engine.worker.dispatch import Dispatcher

    def triton_paged(q, k, v, out, layer, kv_cache, meta):
        assert v.shape[0] == 1 or v.stride(0) > v.shape[1] * v.shape[2]  # the model's v: a view of the fused rows
        triton_attention.paged_attention(q, k, v, out, layer, kv_cache, meta,
                                         num_splits=3 if meta.is_uniform_decode else None)

    monkeypatch.setattr(reference, "paged_attention", triton_paged)
    path, expected = gemma
    llm = LLM(str(path), **SMALL, compile=False, async_scheduling=True, enable_prefix_caching=True)
    runner = llm.runtime.runner
    graphs = runner.decode_graphs = _EagerDecodeGraphs(runner, (1, 4))  # batches of 2 and 3 pad to 4
    runner.dispatcher = Dispatcher(graphs.sizes, (), decode_graphs_wanted=True)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats()["modes"]["full"] == graphs.replays > 0 and graphs.padded_replays > 0
    pool = llm.runtime.block_pool
    assert pool.sliding[0].released_blocks > 0
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert pool.sliding[0].num_free_blocks == pool.sliding[0].num_usable_blocks


def test_a_long_sequence_holds_a_bounded_number_of_sliding_blocks(gemma):
    path, expected = gemma
    llm = LLM(str(path), **SMALL)
    pool = llm.runtime.block_pool
    sliding = pool.sliding[0]
    bound = sliding.max_blocks_per_request(SMALL["max_num_batched_tokens"])  # ceil((W - 1 + 8) / 4) + 1 = 5
    llm.add_request(PROMPTS[3], PARAMS, request_id="long")
    held, full_held = [], []
    while llm.has_unfinished_requests():
        llm.step()
        if sliding.table("long"):
            held.append(sliding.num_held("long"))
            full_held.append(len(pool.block_table("long")))
    assert max(held) <= bound and held[-1] <= -(-(WINDOW - 1) // BLOCK) + 1 + 1
    assert max(full_held) >= 9  # the full group keeps every block: 21 + 20 tokens
    assert sliding.num_free_blocks == sliding.num_usable_blocks


def test_preempted_gemma_requests_recompute_through_both_pools(gemma):
    path, expected = gemma
    # 18 blocks of every layer: the full group gets about 20, enough for one request of 64 tokens
    # but not for four growing ones.
    llm = LLM(str(path), **{**SMALL, "max_num_batched_tokens": 32, "num_gpu_blocks": 18})
    outputs = llm.generate(PROMPTS, PARAMS)
    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == expected


def test_one_pool_for_gemma_on_request_and_for_llama_always(gemma, tmp_path):
    path, expected = gemma
    llm = LLM(str(path), **SMALL, hybrid_kv_cache=False)
    assert isinstance(llm.runtime.block_pool, BlockPool) and len(llm.stats()["kv_groups"]) == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    llama = random_hf_model(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128), seed=3)
    llama.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **SMALL, num_gpu_blocks=40)
    assert isinstance(llm.runtime.block_pool, BlockPool) and llm.runtime.block_pool.num_blocks == 40
    assert llm.runtime.runner.buffers.group_tables == []
    assert [g["kind"] for g in llm.stats()["kv_groups"]] == ["full"]


def test_the_memory_budget_is_split_by_what_one_sequence_needs_of_each_group():
    # 1 full layer (bytes 1 per block) and 5 sliding ones (5): one 64-block sequence needs 64 full
    # blocks and 3 sliding ones: 64 + 15 = 79 bytes, so a 790-byte budget holds 10 sequences.
    assert split_memory(790, [1, 5], [64, 3], [65, 4]) == [641, 31]
    assert split_memory(10, [1, 5], [64, 3], [65, 4]) == [65, 4]  # never below one request


def _published_pool(num_full_blocks: int = 20) -> tuple[GroupedBlockPool, list[int]]:
    """A request of 24 tokens (6 blocks of 4, and a 7th for its next token) computed, published and
    finished: the full group caches blocks 0..5; the sliding group (window 8) released its blocks
    0..3 as it went, but had published them first."""
    pool = GroupedBlockPool(BlockPool(num_full_blocks, BLOCK, debug_checks=True), [SlidingBlockPool(20, BLOCK, WINDOW)])
    pool.enable_prefix_caching()
    tokens = list(range(100, 125))
    assert pool.admit("a", [], 8)
    for end in range(8, 25, 4):
        pool.publish("a", tokens, end)
        pool.release_before("a", end)
        assert pool.grow("a", end + 4)
    pool.free("a")
    pool.check_consistency()
    return pool, tokens


def test_a_prefix_hit_needs_the_sliding_blocks_of_its_last_window():
    pool, tokens = _published_pool()
    sliding = pool.sliding[0]
    assert len(pool.match_prefix(tokens)) == 6  # 24 tokens: every window block still cached
    # Evict the sliding block of table index 4 (positions 16..19): a hit of 24 tokens needs indices
    # 4, 5 (positions 17..23), a hit of 20 needs 3, 4: the longest usable hit is 16 tokens.
    full_block = pool.full.match_prefix(tokens)[4]
    sliding._unpublish(sliding.lookup(full_block, pool.full.cache.node(full_block)))
    assert len(pool.full.match_prefix(tokens)) == 6 and len(pool.match_prefix(tokens)) == 4
    assert pool.admit("b", pool.match_prefix(tokens), 17)
    table = sliding.table("b")
    # a hit of 16 tokens: index 2 (positions 9..11, in the window of position 16) onwards is held
    assert table[:2] == [SCRATCH_BLOCK, SCRATCH_BLOCK] and SCRATCH_BLOCK not in table[2:] and len(table) == 5
    pool.check_consistency()


def test_a_full_block_evicted_and_reused_never_hands_out_stale_sliding_blocks():
    pool, tokens = _published_pool(num_full_blocks=8)  # 7 usable: a new request reuses every id
    sliding = pool.sliding[0]
    assert pool.full.reset_prefix_cache() == 6  # the full group forgets; the sliding entries stay
    other = list(range(200, 225))
    assert pool.admit("c", [], 24)
    pool.full.publish("c", other, 24)  # full group only: the sliding blocks under these ids are stale
    assert any(f in sliding._entries for f in pool.full.block_table("c"))
    assert len(pool.full.match_prefix(other)) == 6 and pool.match_prefix(other) == []
    pool.check_consistency()


def test_capacity_suite_reports_gemma_3_1b_fitting_several_times_more_sequences_per_kind():
    from bench.capacity import run
    row, = run("gemma-3-1b", contexts="4096").rows
    # 26 layers, 4 global: one 4k sequence costs 26 layers x 256 blocks in one pool, but 4 x 256 +
    # 22 x 33 (the window of 512 tokens plus a partial block) with a pool per kind: 3.8x
    assert row["one_pool_seqs"] == 157 and 3.7 < row["gain"] < 3.9


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_kernels_never_load_the_table_entries_a_window_pool_released(decode):
    """The Triton kernels (the interpreter on CPU) with every table entry below each sequence's first
    query window pointing at a block of NaN, as a released entry may point at any block: loading one
    would turn the output NaN (0 x NaN), yet it equals the reference over the intact table."""
    from tests.test_triton_attention import DEVICE, check_close, make_batch, make_layer, reference_paged, run_paged
    layer = make_layer(4, 2, 16, window=WINDOW)
    prefix, query = ([30, 13, 2], [1, 1, 1]) if decode else ([30, 13, 0], [6, 9, 5])
    q, k, v, cache, meta = make_batch(prefix, query, layer, block_size=BLOCK, dtype=torch.float32, device=DEVICE)
    ref, _ = reference_paged(q, k, v, cache, meta, layer)
    poison = max(set(range(1, cache.shape[1])) - set(meta.block_tables.flatten().tolist()))
    cache[:, poison] = float("nan")
    tables = meta.block_tables.clone()
    for i, first_query in enumerate(prefix):
        tables[i, :max(0, first_query - WINDOW + 1) // BLOCK] = poison
    assert (tables == poison).sum() >= 5
    meta.block_tables = tables
    out = run_paged(q, k, v, cache, meta, layer, **({"num_splits": 2} if decode else {}))
    check_close(out, ref, meta.num_actual_tokens, torch.float32)


def test_release_keeps_exactly_the_blocks_a_query_at_the_next_position_can_see():
    # window 8, blocks of 4: a query at s sees s - 7 .. s, so block i (positions 4i .. 4i + 3) goes
    # back once 4i + 3 < s - 7, and not a step earlier
    pool = SlidingBlockPool(16, BLOCK, WINDOW)
    pool.admit("r", [], 0, 24)  # a 24-token prefill chunk: 6 blocks
    table = pool.table("r")
    blocks = list(table)
    for next_position, released in ((10, 0), (11, 1), (14, 1), (15, 2), (23, 4)):
        pool.release_before("r", next_position)
        assert table[:released] == [SCRATCH_BLOCK] * released and table[released:] == blocks[released:]
        assert pool.num_held("r") == 6 - released and pool.num_free_blocks == 15 - 6 + released
    pool.check_consistency()
    pool.free("r")
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_holds_is_true_exactly_when_growing_and_releasing_would_change_nothing():
    """The scheduler skips grow and release_before for a request the pools say `holds` its chunk (most
    decode steps); that is safe only if they would have been no-ops, in every group."""
    pool = GroupedBlockPool(BlockPool(32, BLOCK), [SlidingBlockPool(32, BLOCK, WINDOW)])
    assert pool.admit("r", [], 6) and not pool.holds("q", 1, 0)  # q holds nothing
    seen = set()
    for start in range(6, 40):  # one decode token a step, through block and window boundaries
        end = start + 1
        before = ([list(t) for t in pool.tables("r")], pool.full.num_free_blocks, pool.sliding[0].num_free_blocks)
        holds = pool.holds("r", end, start)
        assert holds == (pool.full.holds("r", end, start) and pool.sliding[0].holds("r", end, start))
        pool.release_before("r", start)
        assert pool.grow("r", end)
        after = ([list(t) for t in pool.tables("r")], pool.full.num_free_blocks, pool.sliding[0].num_free_blocks)
        assert holds == (before == after), f"at position {start}"
        seen.add(holds)
        assert pool.holds("r", end, start)  # once reserved, the same chunk needs nothing more
    assert seen == {True, False}
    pool.check_consistency()


@pytest.mark.parametrize("seed", [0, 1])
def test_every_key_a_query_reads_was_computed_from_its_own_prefix_under_sharing_eviction_and_preemption(seed):
    """The scheduler and both pools without a model: each slot remembers the prefix its K/V was
    computed from; before every step, every key in a chunk's reach (all earlier positions in the full
    group, the window in the sliding group) must hold the request's own prefix. Small pools force
    prefix hits, shortened hits, evictions and preemptions; debug checks run every step."""
    import random

    from engine.core.scheduler import Scheduler
    from engine.request import Request
    rng = random.Random(seed)
    window = 6  # not a multiple of the block size
    pool = GroupedBlockPool(BlockPool(24, BLOCK, debug_checks=True), [SlidingBlockPool(12, BLOCK, window)])
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=48,
                          enable_prefix_caching=True)
    stems = [[rng.randrange(3, 9) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    written: dict[tuple[int, int], tuple[int, ...]] = {}  # (group, slot) -> prefix its K/V came from
    count = shortened = 0
    for step in range(400):
        if step % 2 == 0 and count < 40:
            prompt = rng.choice(stems) + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 6))]
            scheduler.add(Request(f"r{count}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True)))
            count += 1
        if scheduler.waiting:
            tokens = scheduler.waiting[0].token_ids
            shortened += len(pool.match_prefix(tokens)) < len(pool.full.match_prefix(tokens))
        out = scheduler.schedule()
        if out.is_empty:
            if not scheduler.has_unfinished() and count >= 40:
                break
            continue
        for chunk in out.chunks:
            request, start, end = chunk.request, chunk.start, chunk.start + chunk.num_tokens
            tokens = request.token_ids
            for group, (table, first) in enumerate(zip(pool.tables(request.request_id),
                                                       (0, max(0, start - window + 1)))):
                for p in range(first, start):
                    slot = table[p // BLOCK] * BLOCK + p % BLOCK
                    assert written.get((group, slot)) == tuple(tokens[:p + 1]), (request.request_id, group, p)
                for p in range(start, end):
                    written[(group, table[p // BLOCK] * BLOCK + p % BLOCK)] = tuple(tokens[:p + 1])
        sampled = [sum(c.request.token_ids[-3:]) % 6 + 3 for c in out.chunks if c.samples]
        scheduler.update(out, sampled, 0.0)
    assert not scheduler.has_unfinished()
    assert scheduler.num_preemptions > 0 and pool.cache.hit_tokens > 0 and shortened > 0
    assert pool.sliding[0].evicted_blocks > 0 and pool.sliding[0].released_blocks > 0
    assert pool.num_free_blocks == pool.num_usable_blocks
