"""Prefix cache and persistent block tables on the CPU, without a model: the block pool's states and
reference counts, admission hits, LRU leaf-first eviction, and the device block-table rows the
runner keeps from step to step (checked against the pool's tables, work counted, not timed)."""
from __future__ import annotations

import random

import pytest
import torch

from custom_ops import SCRATCH_BLOCK
from engine.core.scheduler import Scheduler
from engine.kv.block_pool import BlockPool
from engine.params import SamplingParams
from engine.request import FinishReason, Request, RequestStatus
from engine.worker.model_runner import ModelRunner


def _scheduler(num_blocks: int = 200, block_size: int = 16, budget: int = 256, max_model_len: int = 1200,
               max_num_seqs: int = 8, caching: bool = True) -> Scheduler:
    pool = BlockPool(num_blocks, block_size, debug_checks=True)
    return Scheduler(pool, max_num_seqs, budget, max_model_len, enable_prefix_caching=caching)


def _request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    scheduler.update(out, [token] * sum(c.samples for c in out.chunks), now=0.0)
    return out


def _drain(scheduler: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        _step(scheduler)
    raise AssertionError("requests did not finish")


def test_requests_behind_a_shared_prefix_hit_every_full_block_of_it():
    scheduler = _scheduler()
    prefix = [3 + i % 90 for i in range(1000)]
    first = _request("first", prefix + [1, 2, 3, 4, 5, 6, 7, 8])
    scheduler.add(first)
    _drain(scheduler)
    others = [_request(f"q{i}", prefix + [50 + i] * 8) for i in range(3)]
    for request in others:
        scheduler.add(request)
    out = scheduler.schedule()
    # 1000 shared tokens fill 62 blocks of 16 (992 tokens); each request prefills only the rest.
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(992, 16)] * 3
    stats = scheduler.pool.prefix_cache_stats()
    assert stats["hit_tokens"] == 3 * 992 and stats["query_tokens"] == 4 * 1008
    assert stats["hit_rate"] == pytest.approx(3 * 992 / (4 * 1008))
    tables = [scheduler.pool.block_table(r.request_id) for r in others]
    assert tables[0][:62] == tables[1][:62] == tables[2][:62]  # shared blocks
    assert len({t[62] for t in tables}) == 3                     # the partial block is each one's own


def test_an_identical_prompt_recomputes_at_least_its_last_token():
    scheduler = _scheduler(block_size=4, max_model_len=64)
    for prompt_len, hit in ((8, 4), (9, 8)):  # 8 tokens: the last block holds the last token, so 1 block
        prompt = list(range(10, 10 + prompt_len))
        scheduler.add(_request(f"a{prompt_len}", prompt))
        _drain(scheduler)
        again = _request(f"b{prompt_len}", prompt)
        scheduler.add(again)
        [chunk] = scheduler.schedule().chunks
        assert (chunk.start, chunk.num_tokens, chunk.samples) == (hit, prompt_len - hit, True)
        scheduler.finish(again, FinishReason.STOP)


def test_multi_turn_prompt_hits_the_previous_turn_and_its_answer():
    scheduler = _scheduler(block_size=4, max_model_len=64)
    turn = _request("t1", list(range(10, 21)), max_tokens=6)  # 11 prompt tokens
    scheduler.add(turn)
    _drain(scheduler)
    # 11 + 6 tokens; the last generated token was never computed: 16 computed, all 4 blocks full.
    following = _request("t2", turn.token_ids + [60, 61])
    scheduler.add(following)
    [chunk] = scheduler.schedule().chunks
    assert chunk.start == 16 and chunk.num_tokens == 3


def test_unreferenced_blocks_stay_cached_until_needed_then_the_least_recent_leaf_goes_first():
    # 12 usable blocks of 4 tokens; max_model_len 16 (4 blocks).
    scheduler = _scheduler(num_blocks=13, block_size=4, budget=64, max_model_len=16)
    pool = scheduler.pool
    old, new = list(range(10, 23)), list(range(40, 53))  # 13 tokens: 3 full blocks each, published
    for rid, prompt in (("old", old), ("new", new)):
        scheduler.add(_request(rid, prompt, max_tokens=1))
        _drain(scheduler)
    assert pool.prefix_cache_stats()["cached_blocks"] == 6 and pool.num_free_blocks == 12
    old_blocks = pool.cache.match(old, 3)
    # 7 blocks: 6 free ones, then one eviction: the tail of the least recently released prefix.
    assert pool.admit("x", [], 28)
    assert pool.cache.evicted_blocks == 1
    assert pool.cache.match(old, 3) == old_blocks[:2] and len(pool.cache.match(new, 3)) == 3
    pool.check_consistency()
    pool.free("x")


def test_identical_prompts_at_once_compute_twice_and_publish_once():
    scheduler = _scheduler(block_size=4, max_model_len=64)
    prompt = list(range(10, 23))
    twins = [_request(f"t{i}", prompt) for i in range(2)]
    for request in twins:
        scheduler.add(request)
    out = scheduler.schedule()
    assert [c.start for c in out.chunks] == [0, 0]  # nothing was published when both were admitted
    _drain(scheduler)
    stats = scheduler.pool.prefix_cache_stats()
    assert stats["cached_blocks"] == 4  # one copy of each full block (13 + 3 computed tokens = 4 blocks)
    late = _request("late", prompt)
    scheduler.add(late)
    [chunk] = scheduler.schedule().chunks
    assert chunk.start == 12


def test_a_preempted_request_is_readmitted_on_its_own_published_blocks():
    scheduler = _scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24)
    old, new = _request("old", list(range(10, 18)), max_tokens=12), _request("new", list(range(40, 48)), 12)
    scheduler.add(old)
    scheduler.add(new)
    readmitted = None
    for _ in range(60):
        out = _step(scheduler)
        if new.num_preemptions and readmitted is None:
            readmitted = next((c for c in out.chunks if c.request is new), None)
        if not scheduler.has_unfinished():
            break
    assert new.num_preemptions >= 1 and readmitted is not None
    assert readmitted.start > 0 and readmitted.start % 4 == 0  # it hit what it had published
    assert old.is_finished and new.is_finished and len(new.output_token_ids) == 12
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_usable_blocks


def test_finish_of_a_waiting_or_running_request_drops_its_references():
    scheduler = _scheduler(block_size=4, max_model_len=64)
    running, waiting = _request("run", list(range(10, 30))), _request("wait", list(range(10, 30)))
    scheduler.add(running)
    _step(scheduler)
    scheduler.add(waiting)
    scheduler.finish(running, FinishReason.STOP)  # as LLM.abort does
    scheduler.finish(waiting, FinishReason.STOP)
    pool = scheduler.pool
    assert not scheduler.has_unfinished() and pool.block_table("run") == []
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert pool.prefix_cache_stats()["cached_blocks"] == 5  # its 20 computed tokens stay cached
    pool.check_consistency()


def test_debug_checks_refuse_a_write_into_a_published_block():
    scheduler = _scheduler(block_size=4, max_model_len=64)
    request = _request("a", list(range(10, 22)))
    scheduler.add(request)
    _drain(scheduler)
    reader = _request("b", list(range(10, 22)) + [5])
    scheduler.add(reader)
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="shared .* or published"):
        scheduler.pool.check_writable("b", 0, 1)  # block 0 of b is the cached block of a


def test_prefix_caching_off_publishes_nothing():
    scheduler = _scheduler(block_size=4, max_model_len=64, caching=False)
    for rid in "ab":
        scheduler.add(_request(rid, list(range(10, 30))))
        out = scheduler.schedule()
        assert out.chunks[0].start == 0
        _drain(scheduler)
    assert scheduler.pool.prefix_cache_stats() == {"enabled": False, "query_tokens": 0, "hit_tokens": 0,
                                                     "hit_rate": 0.0, "cached_blocks": 0, "evicted_blocks": 0}


def _runner(max_seqs: int, block_size: int, max_model_len: int, max_tokens: int = 512) -> ModelRunner:
    """A runner without a model: _prepare only fills the static buffers."""
    return ModelRunner(None, None, block_size, max_model_len, max_tokens, max_seqs, torch.device("cpu"))


def _check_rows(runner: ModelRunner, out, pool: BlockPool, num_rows: int) -> None:
    rows = runner.buffers.block_tables
    for i, chunk in enumerate(out.chunks):
        table = pool.block_table(chunk.request.request_id)
        assert rows[i, :len(table)].tolist() == table, f"row {i} of {chunk.request.request_id}"
    for i in range(len(out.chunks), num_rows):  # padding rows read entry 0 only
        assert int(rows[i, 0]) == SCRATCH_BLOCK


def test_random_add_step_finish_abort_preempt_keep_every_block_in_exactly_one_state():
    rng = random.Random(0)
    block_size, max_seqs = 4, 6
    scheduler = _scheduler(num_blocks=24, block_size=block_size, budget=24, max_model_len=40, max_num_seqs=max_seqs)
    pool = scheduler.pool
    runner = _runner(max_seqs, block_size, 40)
    prefixes = [[3 + (7 * p + i) % 50 for i in range(rng.randint(2, 14))] for p in range(3)]
    live: list[Request] = []
    for op_index in range(400):
        op = rng.choice(["add", "add", "step", "step", "step", "finish", "preempt"])
        if op == "add" and len(live) < 10:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 60) for _ in range(rng.randint(1, 9))]
            request = _request(f"r{op_index}", prompt, max_tokens=rng.randint(1, 8))
            scheduler.add(request)
            live.append(request)
        elif op == "finish" and live:  # a stop condition, or an abort of a waiting or running request
            request = live.pop(rng.randrange(len(live)))
            scheduler.finish(request, FinishReason.STOP)
        elif op == "preempt" and scheduler.running:
            victim = scheduler.running.pop(rng.randrange(len(scheduler.running)))
            scheduler._preempt(victim)
        else:
            out = scheduler.schedule()  # debug checks: no write into a shared block, states add up
            if not out.is_empty:
                full = out.is_uniform_decode and rng.random() < 0.5
                padded = min(max_seqs, out.num_tokens + rng.randint(0, 2)) if full else out.num_tokens
                runner._prepare(out, pool, padded, full)
                _check_rows(runner, out, pool, padded if full else len(out.chunks))
            finished = scheduler.update(out, [rng.randrange(3, 60) for c in out.chunks if c.samples], now=0.0)
            live = [r for r in live if r not in finished]
        assert min(pool._refs) >= 0
        for request in scheduler.waiting:
            assert request.status is RequestStatus.WAITING and pool.block_table(request.request_id) == []
        pool.check_consistency()
    assert pool.prefix_cache_stats()["hit_tokens"] > 0 and pool.cache.evicted_blocks > 0
    assert runner.buffers.tables.rows_moved > 0


@pytest.mark.parametrize("grouped", [False, True], ids=["one-group", "full+sliding"])
def test_a_decode_step_stages_what_the_general_path_stages(grouped):
    """ModelRunner._decode_lists (the host's fast path for steps of 1-token chunks) against
    _chunk_lists on the same steps: tokens in flight (the overlapped loop's), 1-token prefill chunks
    that sample nothing, finished and preempted requests, and a sliding-window group beside the full one."""
    from engine.kv.grouped_pool import GroupedBlockPool
    from engine.kv.sliding_pool import SlidingBlockPool
    rng = random.Random(1)
    block_size, max_seqs = 4, 6
    full = BlockPool(40, block_size, debug_checks=True)
    pool = GroupedBlockPool(full, [SlidingBlockPool(40, block_size, 8)]) if grouped else full
    scheduler = Scheduler(pool, max_seqs, max_seqs, 60, enable_prefix_caching=True)  # 1-token prefill chunks too
    runner = _runner(max_seqs, block_size, 60)
    if grouped:
        runner.group_layers = [("sliding.0",)]
        runner.buffers.set_num_groups(2)
    in_flight: list[Request] = []
    decode_steps = inflight_rows = quiet_rows = 0
    for op_index in range(300):
        op = rng.choice(["add", "add", "step", "step", "step", "finish"])
        if op == "add" and len(scheduler.running) + len(scheduler.waiting) < 9:
            scheduler.add(_request(f"r{op_index}", [rng.randrange(3, 60) for _ in range(rng.randint(1, 12))],
                                   max_tokens=rng.randint(1, 12)))
        elif op == "finish" and scheduler.running:
            scheduler.finish(rng.choice(scheduler.running), FinishReason.STOP)
        else:
            out = scheduler.schedule()
            if out.is_uniform_decode:
                decode_steps += 1
                inflight_rows += sum(c.start >= c.request.num_tokens for c in out.chunks)
                quiet_rows += sum(not c.samples for c in out.chunks)
                assert runner._decode_lists(out, pool) == runner._chunk_lists(out, pool, False)
            if not out.is_empty:
                runner._prepare(out, pool, out.num_tokens, False)
            scheduler.advance(out)
            for request in in_flight:  # the previous step's tokens are read one step late
                scheduler.resolve_token(request, rng.randrange(3, 60), 0.0)
            in_flight = [c.request for c in out.chunks if c.samples]
    assert decode_steps > 20 and inflight_rows > 20 and quiet_rows > 0, (decode_steps, inflight_rows, quiet_rows)


@pytest.mark.parametrize("context", [32, 2048])
def test_block_table_rows_copy_only_new_entries_whatever_the_context(context):
    """The host work of a decode step's block tables is the same at 32 and 2,048 tokens of context."""
    block_size, batch = 16, 8
    scheduler = _scheduler(num_blocks=batch * (context // block_size + 4) + 1, block_size=block_size,
                           budget=batch * context, max_model_len=context + 64, max_num_seqs=batch, caching=False)
    runner = _runner(batch, block_size, context + 64, max_tokens=batch * context)
    requests = [_request(str(i), [3 + (i + j) % 50 for j in range(context)], max_tokens=40) for i in range(batch)]
    for request in requests:
        scheduler.add(request)
    tables = runner.buffers.tables
    for step in range(34):  # one prefill step, then decodes
        if step == 2:
            copied_before, moved_before = tables.entries_copied, tables.rows_moved
        out = scheduler.schedule()
        runner._prepare(out, scheduler.pool, out.num_tokens, False)
        _check_rows(runner, out, scheduler.pool, len(out.chunks))
        scheduler.update(out, [7] * len(out.chunks), now=0.0)
    # 32 decode steps cross 2 block boundaries per request: 2 entries each, nothing else copied.
    assert tables.entries_copied - copied_before == 2 * batch and tables.rows_moved == moved_before
    # A request that finishes moves the rows after it up: on the device, with no entry re-sent.
    scheduler.finish(requests[1], FinishReason.STOP)
    copied_before = tables.entries_copied
    out = scheduler.schedule()
    runner._prepare(out, scheduler.pool, out.num_tokens, False)
    _check_rows(runner, out, scheduler.pool, len(out.chunks))
    assert tables.rows_moved == moved_before + batch - 2 and tables.entries_copied == copied_before


def test_a_block_table_wider_than_a_row_is_refused_before_anything_changes():
    runner = _runner(max_seqs=2, block_size=4, max_model_len=8)  # rows of 2 entries
    tables = runner.buffers.tables
    ok = [3, 4]
    tables.update([ok])
    with pytest.raises(ValueError, match="rows of 2"):
        tables.update([[5], [6, 7, 8]])
    tables.update([ok])
    assert runner.buffers.block_tables[0].tolist() == [3, 4] and tables.entries_copied == 2


def test_used_width_is_the_longest_table_of_the_step_rows():
    """What a tensor-parallel step sends of the tables: the step's rows up to its longest table."""
    runner = _runner(max_seqs=4, block_size=4, max_model_len=64)  # rows of 16 entries
    tables = runner.buffers.tables
    tables.update([[3], [4, 5, 6], []])
    assert tables.used_width(3) == 3 and tables.used_width(1) == 1
    tables.update([[], []])
    assert tables.used_width(2) == 1  # padding rows: the scratch entry
    tables.reset()
    assert tables.used_width(4) == 1
