"""Async scheduling (engine/core/step_loop.py at depth 1) gives exactly the synchronous loop's tokens.

The host runs one step ahead: tokens stay on the device and reach the next step's input ids there,
stop conditions are applied one step late and the token a finished request sampled after its end is
discarded. Each test runs the same requests through the synchronous loop (async_scheduling=False)
and the async one on a tiny float32 Llama on the CPU, across chunked prefill mixed with decodes,
preemption, stop tokens, EOS, max_tokens, FULL / PIECEWISE dispatch and seeded sampling.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.step_loop import TokenSlots
from engine.request import FinishReason, Request
from engine.worker.dispatch import Dispatcher
from tests.hf_helpers import random_hf_model
from tests.test_engine_generate import ARCHS, COMMON, PROMPTS, SMALL, _EagerDecodeGraphs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    config_cls, kwargs = ARCHS["llama"]
    path = tmp_path_factory.mktemp("overlap_llama")
    random_hf_model(config_cls(**COMMON, **kwargs), seed=11).save_pretrained(path)
    return path


def _both(path, params, prompts=PROMPTS, **fields):
    """(sync outputs, async outputs, async engine) for the same requests."""
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(path), **{**SMALL, **fields, "async_scheduling": async_scheduling})
        results.append((llm.generate(prompts, params), llm))
    (sync, _), (overlapped, llm) = results
    return sync, overlapped, llm


def _same(sync, overlapped):
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in overlapped] == [o.finish_reason for o in sync]
    for out in overlapped:
        assert out.finished
        assert len(out.inter_token_latencies_s) == len(out.token_ids) - 1


def test_greedy_with_chunked_prefill_max_tokens_and_stop_tokens_equals_the_synchronous_loop(llama_dir):
    greedy = LLM(str(llama_dir), **SMALL, async_scheduling=False).generate(PROMPTS, SamplingParams(max_tokens=12))
    # A stop token taken from the middle of two outputs, so those requests end early and their
    # extra in-flight token must be discarded; max_tokens of 1 ends a request at its prefill.
    params = [SamplingParams(max_tokens=12, stop_token_ids=(greedy[0].token_ids[4],)),
              SamplingParams(max_tokens=1), SamplingParams(max_tokens=7),
              SamplingParams(max_tokens=12, stop_token_ids=(greedy[3].token_ids[2],)),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    sync, overlapped, llm = _both(llama_dir, params)
    _same(sync, overlapped)
    assert [o.finish_reason for o in overlapped][:4] == ["stop", "length", "length", "stop"]
    assert len(overlapped[1].token_ids) == 1 and len(overlapped[2].token_ids) == 7
    stats = llm.stats()
    assert stats["async_scheduling"] and stats["async_overlapped_steps"] > 0
    assert stats["async_discarded_tokens"] >= 2  # the two stopped requests each sampled once more
    assert stats["generated_tokens"] == sum(len(o.token_ids) for o in overlapped)
    assert not llm.has_unfinished_requests() and llm.runtime.block_pool.num_free_blocks == \
        llm.runtime.block_pool.num_usable_blocks


def test_preemption_under_async_scheduling_equals_the_synchronous_loop(llama_dir):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    sync, overlapped, llm = _both(llama_dir, params, max_num_batched_tokens=32, num_gpu_blocks=18)
    _same(sync, overlapped)
    assert llm.stats()["preemptions"] > 0 and any(o.num_preemptions for o in overlapped)


def test_seeded_sampling_draws_the_same_noise_as_the_synchronous_loop(llama_dir):
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=5),
              SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=6),
              SamplingParams(max_tokens=10, temperature=1.3, top_p=0.8, seed=7),
              SamplingParams(max_tokens=10),
              SamplingParams(max_tokens=10, temperature=1.0, top_k=3, top_p=0.9, seed=8)]
    sync, overlapped, _ = _both(llama_dir, params)
    _same(sync, overlapped)
    unseeded = LLM(str(llama_dir), **SMALL).generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0,
                                                                            ignore_eos=True))
    assert all(len(o.token_ids) == 6 and all(0 <= t < COMMON["vocab_size"] for t in o.token_ids)
               for o in unseeded)


@pytest.mark.parametrize("decode_sizes,piece_sizes", [((2, 4), (3, 8)), ((1, 2, 4), ())])
def test_full_and_piecewise_steps_read_their_input_ids_from_the_device(llama_dir, decode_sizes, piece_sizes):
    """FULL steps replay the (here eager) decode graph over the static input_ids buffer: the device
    gather must write the previous step's tokens there before the replay."""
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(str(llama_dir), **SMALL, async_scheduling=async_scheduling)
        runner = llm.runtime.runner
        runner.decode_graphs = _EagerDecodeGraphs(runner, decode_sizes)
        runner.dispatcher = Dispatcher(decode_sizes, piece_sizes, decode_graphs_wanted=True,
                                       piecewise_graphs_wanted=bool(piece_sizes))
        outs.append(llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True)))
        assert llm.stats()["modes"]["full"] > 0
    _same(*outs)


def test_streamed_outputs_report_every_token_once_and_never_one_past_the_end(llama_dir):
    sync = LLM(str(llama_dir), **SMALL, async_scheduling=False).generate(PROMPTS[:3], SamplingParams(max_tokens=8))
    stop = sync[0].token_ids[3]
    llm = LLM(str(llama_dir), **SMALL)
    ids = [llm.add_request(p, SamplingParams(max_tokens=8, stop_token_ids=(stop,))) for p in PROMPTS[:3]]
    seen = {rid: [] for rid in ids}
    steps = 0
    while llm.has_unfinished_requests():
        steps += 1
        assert steps < 100
        for out in llm.step():
            assert out.token_ids[:len(seen[out.request_id])] == seen[out.request_id]
            assert len(out.token_ids) == len(seen[out.request_id]) + 1  # one new token per report
            seen[out.request_id] = out.token_ids
        # between steps a request holds only tokens read back, and at most one in flight
        assert all(r.num_planned_tokens - r.num_tokens in (0, 1) for r in llm._requests.values())
    want = [o.token_ids[:o.token_ids.index(stop) + 1] if stop in o.token_ids else o.token_ids for o in sync]
    assert [seen[rid] for rid in ids] == want


def test_a_request_finished_while_its_token_is_in_flight_reports_no_more_tokens(llama_dir):
    """What LLM.abort relies on: between steps a request holds only the tokens read back (its
    in-flight step already counted as computed); the scheduler finishes it, and the next step
    discards the token in flight and frees its slot and blocks."""
    llm = LLM(str(llama_dir), **SMALL)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    keep, gone = llm.add_request(PROMPTS[0], params), llm.add_request(PROMPTS[2], params)
    for _ in range(4):
        llm.step()
    request = llm._requests[gone]
    assert request.num_inflight_tokens == 1 and request.num_planned_tokens == request.num_tokens + 1
    assert request.num_computed_tokens == request.num_tokens  # the in-flight step computed its last token
    reported = list(request.output_token_ids)
    llm.scheduler.finish(request, FinishReason.STOP)  # as an abort does
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id != gone
            finished[out.request_id] = out
    assert list(finished) == [keep] and len(finished[keep].token_ids) == 8
    assert request.token_ids == request.prompt_token_ids + reported
    assert llm.stats()["async_discarded_tokens"] >= 1 and not llm._loop.slots._slots
    assert llm.runtime.block_pool.num_free_blocks == llm.runtime.block_pool.num_usable_blocks


def test_a_request_preempted_with_its_token_in_flight_is_readmitted_with_that_token(llama_dir):
    """Its recompute prefill covers the position of the token still in flight: that input id comes
    from the device slot, and the outputs are those of a run without preemption."""
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(llama_dir), **SMALL, async_scheduling=False).generate(PROMPTS[:3], params)]
    llm = LLM(str(llama_dir), **SMALL)
    ids = [llm.add_request(p, params) for p in PROMPTS[:3]]
    for _ in range(5):
        llm.step()
    request = llm._requests[ids[2]]
    in_flight = request.num_tokens  # the position of its token in flight
    assert request.num_inflight_tokens == 1
    llm.scheduler.running.remove(request)
    llm.scheduler._preempt(request)  # as the scheduler does when blocks run short
    launch, refills = llm._loop._launch, []

    def spy(out):
        refills.extend(c for c in out.chunks if c.request is request and c.start <= in_flight < c.start + c.num_tokens)
        return launch(out)

    llm._loop._launch = spy
    outputs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id] = out.token_ids
    assert refills and refills[0].num_tokens > 1  # the in-flight token was an input of its recompute prefill
    assert [outputs[i] for i in ids] == expected and request.num_preemptions == 1


def test_token_slots_grow_without_losing_tokens():
    slots = TokenSlots(2, torch.device("cpu"))
    requests = [Request(str(i), [1], SamplingParams()) for i in range(5)]
    for i, request in enumerate(requests):
        slot = slots.slot(request)  # may grow the buffer: index the new one
        slots.tokens[slot] = 10 + i
    assert slots.tokens.numel() >= 5
    assert [int(slots.tokens[slots.slot(r)]) for r in requests] == [10, 11, 12, 13, 14]
    assert len({slots.slot(r) for r in requests}) == 5


# -- GPU: decode graphs alone, decode and prefill graphs, no graphs ------------------------------------------------

def _mixed_workload(llm: LLM) -> dict[str, tuple[list[int], str]]:
    """Staggered arrivals; greedy, seeded top-k / top-p sampling, stop tokens and EOS; the finished
    outputs by request id."""
    from tests.test_engine_gpu import WORKLOAD
    pending = list(enumerate(WORKLOAD))
    results: dict[str, tuple[list[int], str]] = {}
    step = 0
    while pending or llm.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens) = pending.pop(0)
            if i % 3 == 0:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            elif i % 3 == 1:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=20, top_p=0.9, seed=i)
            else:
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(prompt[-1], 17, 33))
            llm.add_request(prompt, params, request_id=str(i))
        for out in llm.step():
            if out.finished:
                results[out.request_id] = (out.token_ids, out.finish_reason)
        step += 1
        assert step < 5000
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [
    dict(cuda_graphs=True, prefill_graphs=False),    # FULL_DECODE_ONLY: decode graphs + NONE
    dict(cuda_graphs=True, prefill_graphs=True),     # FULL_AND_PIECEWISE
    dict(cuda_graphs=False, prefill_graphs=False),   # NONE only
], ids=["decode_graphs", "decode_and_prefill_graphs", "graphs_off"])
def test_gpu_async_scheduling_gives_the_synchronous_tokens(tmp_path, graphs):
    from tests.test_engine_generate import _build_hf
    from tests.test_engine_gpu import _engine
    _build_hf("llama").save_pretrained(tmp_path)
    results, stats = {}, {}
    for async_scheduling in (False, True):
        llm = _engine(tmp_path, async_scheduling=async_scheduling, **graphs)
        results[async_scheduling] = _mixed_workload(llm)
        stats[async_scheduling] = llm.stats()
        llm.close()
    assert results[True] == results[False]
    assert {reason for _, reason in results[True].values()} >= {"length"}
    overlapped = stats[True]
    assert overlapped["async_overlapped_steps"] > overlapped["steps"] // 2
    if graphs["cuda_graphs"]:
        assert overlapped["modes"]["full"] > 0
    if graphs["prefill_graphs"]:
        assert overlapped["modes"]["piecewise"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", ["greedy", "seeded_top_k_top_p", "penalties_and_logprobs"])
@pytest.mark.parametrize("step_kind", ["full_decode", "piecewise_mixed"])
def test_gpu_step_returns_while_the_step_it_launched_still_runs(tmp_path, sampling, step_kind):
    """Nothing on the launch path waits for the device (a pageable copy to CUDA, a .tolist(), an
    .item() would): with a long sleep queued ahead of a step, step() returns before it has run."""
    from tests.test_engine_generate import _build_hf
    from tests.test_engine_gpu import _engine
    _build_hf("llama").save_pretrained(tmp_path)
    llm = _engine(tmp_path, cuda_graphs=True, prefill_graphs=True)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{
        "greedy": {}, "seeded_top_k_top_p": dict(temperature=0.8, top_k=5, top_p=0.9, seed=1),
        "penalties_and_logprobs": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                       logprobs=3, min_tokens=40, min_p=0.1, temperature=0.7, seed=3)}[sampling])
    llm.add_request([1, 5, 9, 13, 17], params)
    for _ in range(4):  # prefill, then decodes: every path warm
        llm.step()
    if step_kind == "piecewise_mixed":
        llm.add_request([1, 7, 8, 9], params)  # the next step mixes a prefill with the decode
    execute = llm.runtime.runner.execute
    modes_before = dict(llm.stats()["modes"])

    def behind_a_sleep(*args, **kwargs):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the step
        return execute(*args, **kwargs)

    llm.runtime.runner.execute = behind_a_sleep
    llm.step()
    inflight = llm._loop._inflight
    assert inflight is not None and inflight.ready is not None
    assert not inflight.ready.query(), "step() waited for the device"
    mode = "full" if step_kind == "full_decode" else "piecewise"
    assert llm.stats()["modes"][mode] == modes_before.get(mode, 0) + 1
    llm.runtime.runner.execute = execute
    while llm.has_unfinished_requests():
        llm.step()
    llm.close()


def test_a_request_aborted_with_no_token_in_flight_gives_its_token_slot_back(llama_dir):
    llm = LLM(str(llama_dir), **SMALL)
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    while not llm._loop.slots._slots:  # until it has sampled: it owns a device token slot
        llm.step()
    llm._loop.drain()  # its in-flight token is read: nothing of it is in flight any more
    [request] = llm._loop.slots._slots
    assert llm.abort(rid)
    assert request not in llm._loop.slots._slots
    assert [o.finish_reason for o in llm.step() if o.request_id == rid] == ["abort"]
    assert llm.runtime.block_pool.num_free_blocks == llm.runtime.block_pool.num_usable_blocks
    llm.close()
