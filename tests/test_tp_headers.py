"""The step headers' shared-memory path on its own: order, acknowledgement, a torn write never taken,
and waits that end (rank 0 waiting on a follower that stopped taking headers). The engine's use of it
with spawned ranks is in test_tp."""
from __future__ import annotations

import threading

import pytest

from engine.distributed import headers
from engine.distributed.headers import STATS, STEP, STOP, SharedHeaders, StepHeader


@pytest.fixture
def pair():
    leader = SharedHeaders(0, 2, timeout_s=2.0)
    follower = SharedHeaders(1, 2, name=leader.name, timeout_s=2.0)
    yield leader, follower
    follower.close()
    leader.close()


def test_every_header_arrives_once_and_in_order(pair):
    leader, follower = pair
    sent = [StepHeader(STEP, num_tokens=n, num_padded=n + 1, table_width=3 * n) for n in range(1, 200)]
    sent += [StepHeader(STATS), StepHeader(STOP)]
    got = []

    def follow() -> None:
        while not got or got[-1].op != STOP:
            got.append(follower.receive())

    thread = threading.Thread(target=follow)
    thread.start()
    for header in sent:
        leader.send(header)
    thread.join(10)
    assert got == sent


def test_a_follower_never_takes_a_header_rank_0_is_still_writing(pair):
    leader, follower = pair
    leader.send(StepHeader(STEP, num_tokens=5))
    assert follower.receive() == StepHeader(STEP, num_tokens=5)
    # rank 0 stopped between the trailing seq and the leading one: the follower must wait
    leader.slots[-1] = leader.seq + 1
    leader.slots[leader._header_at] = 7
    taken = []
    thread = threading.Thread(target=lambda: taken.append(follower.receive()))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and not taken
    leader.slots[0] = leader.seq + 1  # the write completes
    thread.join(5)
    assert taken == [StepHeader(*([7] * headers.HEADER_LEN))]


def test_rank_0_waiting_on_a_follower_that_stopped_reading_raises_or_times_out(pair):
    leader, _ = pair
    leader.send(StepHeader(STEP, num_tokens=1))  # never taken
    dead = RuntimeError("rank 1 (pid 123) exited with code 9")

    def alive() -> None:
        raise dead

    with pytest.raises(RuntimeError, match="rank 1"):
        leader.send(StepHeader(STEP, num_tokens=2), alive)
    with pytest.raises(TimeoutError, match="take the last step header"):
        leader.send(StepHeader(STEP, num_tokens=2))
