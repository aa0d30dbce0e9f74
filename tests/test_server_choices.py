"""Choices under a consumer that falls behind: the outputs waiting for one choice are read as one,
joined exactly, in order, with errors still raised where they stood."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine.entrypoints.server.choices import Choices
from engine.entrypoints.server.engine_loop import ACCEPTED
from engine.outputs import RequestOutput, merged
from engine.params import SamplingParams
from engine.request import TokenLogprobs


class FakeEngine:
    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def submit(self, prompt, params, request_id, into, index=0, every_step=True) -> None:
        self.submitted.append(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def out(ids, text, finished=False, ttft=None, logprobs=False) -> RequestOutput:
    lp = [TokenLogprobs(token_id=i, logprob=-float(i)) for i in ids] if logprobs else None
    return RequestOutput("r", [1, 2], list(ids), text, finished, "length" if finished else None, ttft, new_logprobs=lp)


def test_merged_joins_the_deltas_and_keeps_the_first_ttft_and_the_last_state():
    a, b = out([5, 6], "ab", ttft=0.25, logprobs=True), out([7], "c", finished=True, logprobs=True)
    m = merged(a, b)
    assert (m.new_token_ids, m.new_text, m.finished, m.finish_reason, m.ttft_s) == ([5, 6, 7], "abc", True, "length", 0.25)
    assert [lp.token_id for lp in m.new_logprobs] == [5, 6, 7]
    assert merged(out([1], "x"), out([2], "y")).new_logprobs is None
    assert a.new_token_ids == [5, 6] and b.new_token_ids == [7]  # the inputs are left alone
    # every other field is the later output's, whatever it holds
    later = dataclasses.replace(b, request_id="r9", prompt_token_ids=[3], num_preemptions=2, history=object())
    m = merged(a, later)
    for f in dataclasses.fields(RequestOutput):
        if f.name not in ("new_token_ids", "new_text", "new_logprobs", "ttft_s"):
            assert getattr(m, f.name) is getattr(later, f.name), f.name


def _read_all(put, n=1):
    async def run():
        choices = Choices(FakeEngine(), [1, 2], SamplingParams(max_tokens=8), "cmpl-x", n)
        choices.queue.put_nowait((0, ACCEPTED))
        await choices.accepted()
        put(choices.queue)  # everything arrives before the consumer runs: it fell behind
        got = []
        try:
            async for index, o in choices:
                got.append((index, o.new_token_ids, o.new_text, o.finished))
        except RuntimeError as exc:
            got.append(("raised", str(exc)))
        return got
    return asyncio.run(asyncio.wait_for(run(), 10))


def test_a_consumer_that_fell_behind_reads_one_output_per_choice_in_order():
    def put(q):
        for step in range(3):
            q.put_nowait((0, out([10 + step], f"{step}")))
            if step == 0:
                q.put_nowait((1, ACCEPTED))
            else:
                q.put_nowait((1, out([20 + step], f"<{step}>")))
        q.put_nowait((0, out([13], "3", finished=True)))
        q.put_nowait((1, out([23], "<3>", finished=True)))
    assert _read_all(put, n=2) == [(0, [10, 11, 12, 13], "0123", True), (1, [21, 22, 23], "<1><2><3>", True)]


def test_merging_stops_at_a_finished_output_and_before_an_error():
    def put(q):
        q.put_nowait((0, out([1], "a")))
        q.put_nowait((0, out([2], "b")))
        q.put_nowait((None, RuntimeError("client disconnected")))
        q.put_nowait((0, out([3], "c", finished=True)))
    assert _read_all(put) == [(0, [1, 2], "ab", False), ("raised", "client disconnected")]


@pytest.mark.parametrize("behind", [False, True])
def test_a_consumer_that_keeps_up_reads_every_step(behind):
    async def run():
        choices = Choices(FakeEngine(), [1, 2], SamplingParams(max_tokens=8), "cmpl-y", 1)
        choices.queue.put_nowait((0, ACCEPTED))
        await choices.accepted()
        got = []

        async def produce():
            for step in range(4):
                choices.queue.put_nowait((0, out([step], str(step), finished=step == 3)))
                if not behind:
                    await asyncio.sleep(0.01)  # the consumer runs between two steps
        producer = asyncio.create_task(produce())
        async for _, o in choices:
            got.append(o.new_token_ids)
        await producer
        return got
    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert [t for ids in got for t in ids] == [0, 1, 2, 3]
    assert len(got) == (1 if behind else 4)


def test_inbox_hands_items_over_in_order_wakes_its_reader_and_loses_nothing_to_a_cancelled_get():
    from engine.entrypoints.server.choices import Inbox

    async def scenario():
        inbox = Inbox()
        assert inbox.empty()
        with pytest.raises(asyncio.QueueEmpty):
            inbox.get_nowait()
        reader = asyncio.create_task(inbox.get())
        await asyncio.sleep(0)
        assert not reader.done()  # it waits for a put
        asyncio.get_running_loop().call_soon(inbox.put_nowait, "a")
        assert await asyncio.wait_for(reader, 5) == "a"
        for item in "bcd":
            inbox.put_nowait(item)
        assert await inbox.get() == "b" and inbox.get_nowait() == "c" and not inbox.empty()
        assert inbox.get_nowait() == "d" and inbox.empty()
        # a reader cancelled while it waits (its client left) leaves a later item for the next get
        reader = asyncio.create_task(inbox.get())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        inbox.put_nowait("e")
        assert await asyncio.wait_for(inbox.get(), 5) == "e"

    asyncio.run(scenario())
