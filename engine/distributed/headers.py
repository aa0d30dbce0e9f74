"""The step header rank 0 sends every other rank before each step, and the two ways it travels.

Every step the followers must learn, on the host, what to run (its size, dispatch and metadata
bounds) before they can join the step's collectives; until they do, rank 0's GPU waits at the
first of them. A gloo broadcast costs a TCP round trip and two thread hand-offs each step. When
every rank runs on this host (spawned ranks always; torchrun when all its ranks are local) the
header goes through shared memory instead: rank 0 writes it and bumps a sequence number, each
follower polls the number, copies the header out and acknowledges it (vLLM's MessageQueue idea,
for one small fixed-size message). Across hosts gloo stays (and where INFER_GRAPHS_TP_HEADERS=gloo).

Shared-memory layout, int64 slots: [seq, ack of rank 1 .. ack of rank N-1, header ..., seq again].
Rank 0 writes the next header only once every follower acknowledged the last (one slot, no queue:
a step needs the previous step's header read anyway), writes the trailing seq, the header, then
the leading seq; a reader takes a header only when the two seqs it reads around it agree, so a
torn read is retried rather than acted on.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import astuple, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["STATS", "STEP", "STOP", "GlooHeaders", "SharedHeaders", "StepHeader", "make_headers", "min_over_ranks"]

STOP, STEP, STATS = 0, 1, 2
# A follower on a GPU polls without sleeping for this long, then backs off: longer than a step (a few ms),
# so a busy engine's next header is taken at once (the follower's delay is rank 0's: its first collective
# waits for it), while an idle engine's followers sleep. On the CPU the ranks' compute needs the cores:
# CPU_SPIN_S.
SPIN_S = 0.05
CPU_SPIN_S = 0.0002
IDLE_SLEEP_S = 0.0005   # the longest sleep between polls of an idle follower
CHECK_EVERY_S = 0.5     # how often a wait asks whether the other side is still alive


@dataclass(frozen=True)
class StepHeader:
    """What a follower needs to replay rank 0's step (zeros but `op` for STOP and STATS)."""
    op: int
    num_tokens: int = 0
    uniform: int = 0
    mode: int = 0           # index into custom_ops.RuntimeMode
    num_padded: int = 0
    num_seqs: int = 0
    num_actual: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    num_sampling: int = 0
    num_chunks: int = 0
    table_width: int = 0


HEADER_LEN = len(StepHeader.__dataclass_fields__)


class GlooHeaders:
    """Headers by a gloo broadcast over the control group (ranks on several hosts)."""

    kind = "gloo"

    def __init__(self, control: Any) -> None:
        self.control = control
        self.tensor = torch.zeros(HEADER_LEN, dtype=torch.int64)

    def send(self, header: StepHeader, alive: Callable[[], None] | None = None) -> None:
        self.tensor.copy_(torch.tensor(astuple(header), dtype=torch.int64))
        dist.broadcast(self.tensor, src=0, group=self.control)

    def receive(self, alive: Callable[[], None] | None = None) -> StepHeader:
        dist.broadcast(self.tensor, src=0, group=self.control)
        return StepHeader(*self.tensor.tolist())

    def close(self) -> None:
        pass


class SharedHeaders:
    """Headers through a shared-memory segment rank 0 made (ranks on one host)."""

    kind = "shared_memory"

    def __init__(self, rank: int, world_size: int, name: str | None = None, timeout_s: float = 300.0,
                 spin_s: float = SPIN_S) -> None:
        from multiprocessing import shared_memory
        self.rank, self.world_size, self.timeout_s, self.spin_s = rank, world_size, timeout_s, spin_s
        slots = world_size + HEADER_LEN + 1
        if name is None:  # rank 0
            self.shm = shared_memory.SharedMemory(create=True, size=8 * slots)
        else:
            # The segment is rank 0's to unlink; without track=False (Python 3.13+) this process's resource
            # tracker would unlink it too at exit, and warn
            try:
                self.shm = shared_memory.SharedMemory(name=name, track=False)
            except TypeError:
                self.shm = shared_memory.SharedMemory(name=name)
                _untrack(self.shm)
        self.slots = torch.frombuffer(self.shm.buf, dtype=torch.int64, count=slots)
        if name is None:
            self.slots.zero_()
        self.seq = 0  # the last header sent (rank 0) or taken (a follower)
        self._header_at = slice(world_size, world_size + HEADER_LEN)

    @property
    def name(self) -> str:
        return self.shm.name

    def send(self, header: StepHeader, alive: Callable[[], None] | None = None) -> None:
        """Rank 0: wait until every follower took the last header, then publish this one. `alive`
        raises when a follower is known dead (checked every CHECK_EVERY_S while waiting)."""
        acks = self.slots[1:self.world_size]
        self._wait(lambda: bool((acks == self.seq).all()), alive, "a tensor-parallel rank to take the last step header")
        self.seq += 1
        self.slots[-1] = self.seq
        self.slots[self._header_at] = torch.tensor(astuple(header), dtype=torch.int64)
        self.slots[0] = self.seq

    def receive(self, alive: Callable[[], None] | None = None) -> StepHeader:
        """A follower: wait for the next header (however long the engine is idle), take it, acknowledge it."""
        want = self.seq + 1
        values: list[int] = []

        def taken() -> bool:
            if int(self.slots[0]) != want:
                return False
            values[:] = self.slots[self._header_at].tolist()
            return int(self.slots[-1]) == want  # else rank 0 was mid-write: read again

        self._wait(taken, alive, None)
        self.seq = want
        self.slots[self.rank] = want
        return StepHeader(*values)

    def _wait(self, ready: Callable[[], bool], alive: Callable[[], None] | None, what: str | None) -> None:
        """Poll `ready`: without sleeping for spin_s, then with sleeps growing to IDLE_SLEEP_S. `what`
        set: give up after timeout_s with a TimeoutError naming it."""
        start = last_check = time.monotonic()
        sleep = 0.0
        while not ready():
            now = time.monotonic()
            if now - start > self.spin_s:
                sleep = min(IDLE_SLEEP_S, sleep + 0.00005)
                time.sleep(sleep)
            if now - last_check > CHECK_EVERY_S:
                last_check = now
                if alive is not None:
                    alive()
                if what is not None and now - start > self.timeout_s:
                    raise TimeoutError(f"waited {self.timeout_s:.0f} s for {what}")

    def close(self) -> None:
        """Unmap (rank 0: and remove) the segment; idempotent."""
        if getattr(self, "slots", None) is None:
            return
        self.slots = None  # the buffer's exports go before the segment closes
        try:
            self.shm.close()
        except BufferError:  # a view still held (a stop send that timed out): the mapping goes at exit
            pass
        if self.rank == 0:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _untrack(shm: Any) -> None:
    """Before Python 3.13: a process that opens (not creates) a segment must not unlink it at exit."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (no public call before 3.13)
    except Exception:  # the tracker only warns at exit: nothing here to fail over
        pass


def make_headers(control: Any, rank: int, world_size: int, timeout_s: float,
                 on_gpu: bool = True) -> GlooHeaders | SharedHeaders:
    """Shared memory when every rank is on this host (told by their host names, gathered over the
    control group), else gloo; a collective, called by every rank at the same point."""
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, (socket.gethostname(), _boot_id()), group=control)
    if len(set(hosts)) != 1 or os.environ.get("INFER_GRAPHS_TP_HEADERS") == "gloo":
        return GlooHeaders(control)
    spin_s = SPIN_S if on_gpu else CPU_SPIN_S
    shared = SharedHeaders(rank, world_size, timeout_s=timeout_s, spin_s=spin_s) if rank == 0 else None
    name = [shared.name if shared else None]
    dist.broadcast_object_list(name, src=0, group=control)
    if rank != 0:
        try:
            shared = SharedHeaders(rank, world_size, name=name[0], timeout_s=timeout_s, spin_s=spin_s)
        except OSError:  # one host name, separate /dev/shm (containers): gloo, below
            shared = None
    # every rank mapped it (or none keeps it) before rank 0 may unlink it
    if min_over_ranks(int(shared is not None), control):
        return shared
    if shared is not None:
        shared.close()
    return GlooHeaders(control)


def min_over_ranks(value: int, control: Any) -> int:
    """The minimum of an int over the ranks of the (gloo) control group: how the ranks agree on the host."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return int(t.item())


def _boot_id() -> str:
    """This machine's boot id where Linux has one: two containers may share a host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
