"""The tensor-parallel all-reduce: symmetric memory for the small messages of inference, NCCL above.

Why. A decode step at batch 1 all-reduces a few KB twice per layer; inside a CUDA graph NCCL spends
~10-20 us on each (its protocol, not the bytes), which at 36 layers is more than the step saves by
splitting the weights. Torch's symmetric memory maps one buffer of every rank into every other rank's
address space (CUDA IPC over NVLink, established once by a collective rendezvous), and ships
all-reduce kernels over it that synchronise through signal pads instead of a protocol:
  one-shot  each rank copies its input into its own buffer, a barrier, then every rank reads all the
            peers' buffers and sums them (one kernel; the bytes read grow with the world size);
  two-shot  reduce-scatter then all-gather over the same buffers (less traffic for larger messages).
Above `two_shot_max_bytes` (and for a dtype or size the kernels refuse) NCCL runs, as before. The
crossovers are the measured ones (bench tp prints each kind's latency in a graph); never NVLink
multicast (multimem): the lent machines disable it, and its kernels are not used here.

Both paths are capture-safe: a CUDA graph records whichever kernels the op launched when it was
captured, and a replay runs them with the same buffers (the symmetric buffer has a fixed address,
and the kernels' closing barrier makes it free for the next all-reduce in the stream).

The op `infer::all_reduce(x, group_name)` is what a traced model calls (Dynamo keeps it as one node,
the fake implementation gives the shape); `register` makes a group's SymmetricAllReduce the one the op
uses, and without one the op is NCCL's (or gloo's) functional all-reduce.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

import torch
from custom_ops.registry import infer_op

__all__ = ["SymmetricAllReduce", "all_reduce", "mapped_group_names", "registered", "register", "unregister"]

logger = logging.getLogger("custom_ops")

ONE_SHOT, TWO_SHOT, NCCL = "one_shot", "two_shot", "nccl"
ALIGN_BYTES = 16  # the kernels load 16 bytes per thread
_REGISTRY: dict[str, SymmetricAllReduce] = {}
_MAPPED_GROUP_NAMES: set[str] = set()  # every group name this process rendezvoused a buffer for


class SymmetricAllReduce:
    """One group's symmetric buffer and the choice of kernel per message size."""

    def __init__(self, group: Any, buffer: torch.Tensor, one_shot_max_bytes: int, two_shot_max_bytes: int,
                 handle: Any = None) -> None:
        self.group = group
        self.handle = handle  # torch's _SymmetricMemory of the buffer: its signal pads (release_waits)
        self.group_name = group.group_name
        self.world_size = group.size()
        self.buffer = buffer  # uint8, symmetric (every rank's is mapped into every rank)
        self.one_shot_max_bytes = one_shot_max_bytes  # past the buffer's size, accepts() refuses either kernel
        self.two_shot_max_bytes = two_shot_max_bytes
        self.calls: Counter[str] = Counter()  # per kind, counted when the op runs eagerly (a capture counts once)

    @staticmethod
    def unavailable(group: Any, device: torch.device) -> str | None:
        """Why this rank cannot map a symmetric buffer for `group` (None: it can). Checked on every rank
        and agreed before `create`, whose rendezvous would otherwise wait forever for a rank that
        never arrives."""
        if torch.device(device).type != "cuda":
            return f"device {device} is not a GPU"
        for op in ("one_shot_all_reduce_copy", "two_shot_all_reduce_out"):
            if not hasattr(torch.ops.symm_mem, op):
                return f"this torch ({torch.__version__}) lacks torch.ops.symm_mem.{op}"
        if group.group_name in _MAPPED_GROUP_NAMES:
            # torch caches a group's rendezvous store by the group's name for the life of the process,
            # and a new group of the same name (the next tensor-parallel engine here) would rendezvous
            # on the old group's store with ranks that joined the new one
            return (f"this process mapped a buffer for an earlier process group named {group.group_name!r} "
                    "(torch keeps its store by name); a later engine in the same process all-reduces over NCCL")
        return None

    @classmethod
    def create(cls, group: Any, device: torch.device, one_shot_max_bytes: int,
               two_shot_max_bytes: int) -> SymmetricAllReduce | None:
        """Allocate and rendezvous the buffer (a collective: every rank of `group` calls this at the
        same point, once every rank's `unavailable` said None); None, with the reason logged, where the
        rendezvous fails (every rank alike: the cause is the machine or the build)."""
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        size = max(one_shot_max_bytes, two_shot_max_bytes)
        _MAPPED_GROUP_NAMES.add(group.group_name)
        try:
            import torch.distributed._symmetric_memory as symm_mem
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None and getattr(enable, "__deprecated__", None) is None:  # older torch needs it
                enable(group.group_name)
            buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(buffer, group.group_name)
        except Exception as exc:
            logger.warning("tensor parallelism: symmetric-memory all-reduce unavailable (%s); using NCCL", exc)
            return None
        return cls(group, buffer, one_shot_max_bytes, two_shot_max_bytes, handle)

    def release_waits(self, device: torch.device, deadline_s: float = 30.0) -> bool:
        """After a peer died: let this rank's queued work finish instead of spinning forever.

        The kernels' barriers spin on signal pads (a put waits for the peer's slot to be 0, a wait for
        this rank's slot to be 1) with no timeout and no abort; a dead peer never does its half. So,
        from a side stream, this rank's own pad is set to 1 and every peer's (still mapped) to 0, again
        and again, until the work queued on `device`'s current stream has drained or `deadline_s`
        passed. The sums computed meanwhile are garbage: only a failed engine calls this, and its
        results are never read. True when the device drained."""
        if self.handle is None:
            return False
        import time
        try:
            rank, world = self.handle.rank, self.handle.world_size
            pads = [self.handle.get_signal_pad(r, dtype=torch.uint32) for r in range(world)]
            drained = torch.cuda.Event()
            drained.record(torch.cuda.current_stream(device))
            side = torch.cuda.Stream(device)
            end = time.monotonic() + deadline_s
            while not drained.query() and time.monotonic() < end:
                with torch.cuda.stream(side):
                    for r, pad in enumerate(pads):
                        pad.fill_(1 if r == rank else 0)
                time.sleep(0.001)
            return drained.query()
        except Exception as exc:  # best effort: the engine already failed and says why
            logger.warning("tensor parallelism: releasing the symmetric-memory waits failed: %s", exc)
            return False

    def kind(self, x: torch.Tensor) -> str:
        """Which kernel all-reduces x: by size, and NCCL for what the symmetric kernels refuse."""
        nbytes = x.numel() * x.element_size()
        if nbytes <= self.one_shot_max_bytes and self.accepts(x, ONE_SHOT):
            return ONE_SHOT
        if nbytes <= self.two_shot_max_bytes and self.accepts(x, TWO_SHOT):
            return TWO_SHOT
        return NCCL

    def accepts(self, x: torch.Tensor, kind: str) -> bool:
        """Whether the kernel `kind` can all-reduce x at all (its dtypes, its alignment, the buffer's size)."""
        nbytes = x.numel() * x.element_size()
        if x.dtype not in (torch.bfloat16, torch.float32) or x.device != self.buffer.device:
            return False
        if nbytes > self.buffer.numel():
            return False
        share = ALIGN_BYTES * (self.world_size if kind == TWO_SHOT else 1)  # two-shot: a whole vector per rank
        return nbytes % share == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.kind(x)
        self.calls[kind] += 1
        return self.run(x, kind)

    def run(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """x all-reduced by the kernel `kind` (bench tp times each kind at each size)."""
        if kind == NCCL:
            return nccl_all_reduce(x, self.group_name)
        flat = x.reshape(-1)
        staging = self.buffer.view(x.dtype)[:flat.numel()]
        if kind == ONE_SHOT:  # the copy into this rank's buffer is inside the kernel
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, flat, "sum", self.group_name).view_as(x)
        staging.copy_(flat)
        out = torch.empty_like(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", self.group_name, out.view(-1))
        return out


def nccl_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def register(comm: SymmetricAllReduce) -> None:
    _REGISTRY[comm.group_name] = comm


def unregister(group_name: str) -> None:
    _REGISTRY.pop(group_name, None)


def mapped_group_names() -> frozenset[str]:
    """The process groups this process has rendezvoused a symmetric buffer for (a later group of the
    same name cannot have one: SymmetricAllReduce.unavailable)."""
    return frozenset(_MAPPED_GROUP_NAMES)


def registered(group_name: str) -> SymmetricAllReduce | None:
    return _REGISTRY.get(group_name)


@infer_op("all_reduce")
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of x over the ranks of `group_name` (out of place), by the group's registered
    SymmetricAllReduce, or NCCL's functional all-reduce where none is registered."""
    comm = _REGISTRY.get(group_name)
    if comm is None:
        return nccl_all_reduce(x, group_name)
    return comm(x)


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)
