"""PersistentBlockTables: the device block tables `[max_seqs, width]`, kept from step to step.

Row i holds the block table of the step's i-th sequence (the attention kernels index tables by
sequence). Instead of re-flattening every table at full width each step (host work growing with
batch x context), a row remembers which table it holds and how many of its entries are already on
the device, and a step copies only what changed:
- new entries at the end of a table (a decode crosses a block boundary once every block_size steps);
- rows whose sequence moved (a request before it finished, or the batch was reordered): moved on the
  device by one gather, never re-sent from the host.
Host work per step is O(rows + new entries), independent of context length.

What it relies on: a table is identified by its list object (BlockPool.block_table), which the pool
only appends to while a request holds it; a preempted request gets a new list when readmitted, so a
row holding the old one is rewritten. The one in-place change: a sliding-window pool
(engine.kv.sliding_pool) replaces entries out of the window by the scratch block; the device row may keep
the old id, which is still in bounds and never read (the kernels load no entry below the window). Entries past a row's table length are stale, never read: the
kernels read entry p // block_size only for positions p < seq_len. A row with an empty table (graph
padding, dummy steps) gets the scratch block in entry 0, all that a one-token padding sequence reads;
`reset` fills every row with the scratch block for dummy steps whose sequences are longer.
"""
from __future__ import annotations

import array
from typing import Sequence

import torch

from custom_ops import SCRATCH_BLOCK

_EMPTY: tuple[int, ...] = ()  # what a row holds after reset, or for an empty table: scratch in entry 0


class PersistentBlockTables:
    """The rows live in `table`, a [max_seqs, width] view of the flat int32 tensor `shared` from index
    `base`: StaticBuffers keeps every KV group's tables in one tensor, so one step's new entries for
    all groups are one index_copy_. Without `shared`, the tables get a tensor of their own."""

    def __init__(self, max_seqs: int, width: int, device: torch.device, pin: bool,
                 shared: torch.Tensor | None = None, base: int = 0) -> None:
        self.max_seqs, self.width = max_seqs, width
        if shared is None:
            shared = torch.full((max_seqs * width,), SCRATCH_BLOCK, dtype=torch.int32, device=device)
        if shared.dim() != 1 or shared.dtype != torch.int32 or base + max_seqs * width > shared.numel():
            raise ValueError(f"PersistentBlockTables: shared must be a flat int32 tensor holding {max_seqs} x {width} "
                             f"entries from {base}, got {shared.dtype} {tuple(shared.shape)}")
        self.shared, self.base = shared, base
        self.table = shared[base:base + max_seqs * width].view(max_seqs, width)
        self._holds: list[Sequence[int]] = [_EMPTY] * max_seqs
        self._synced = [0] * max_seqs  # entries of the held table already on the device
        n = max_seqs * width
        self._index_host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._value_host = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self._move_host = torch.zeros(2 * max_seqs, dtype=torch.int64, pin_memory=pin)
        self._index = torch.zeros(n, dtype=torch.int64, device=device)
        self._value = torch.zeros(n, dtype=torch.int32, device=device)
        self._move = torch.zeros(2 * max_seqs, dtype=torch.int64, device=device)
        # Work counters: tests assert on work done, not on time.
        self.entries_copied = 0
        self.rows_moved = 0

    def used_width(self, rows: int) -> int:
        """Entries in use in the widest of rows 0..rows-1 (at least 1: an empty row's scratch entry);
        what another rank needs of the table to run the step."""
        return max(1, max((len(t) for t in self._holds[:rows]), default=0))

    def reset(self) -> None:
        """Every entry of every row is the scratch block (dummy steps read only block 0)."""
        self.table.fill_(SCRATCH_BLOCK)
        self._holds = [_EMPTY] * self.max_seqs
        self._synced = [0] * self.max_seqs

    def update(self, tables: Sequence[Sequence[int]]) -> None:
        """Make rows 0..len(tables)-1 hold `tables` (host -> device asynchronously; call with the
        staging memory free, i.e. after the previous step's copies ran)."""
        self.ship(*self.plan(tables))

    def plan(self, tables: Sequence[Sequence[int]]) -> tuple[array.array, array.array]:
        """What `update` does, except sending the new entries: rows that moved are moved on the device
        now, and the (flat indices into `shared`, values) still to be written are returned, for
        `ship` or for the caller's own copy (StaticBuffers: inside the step's one staging copy)."""
        holds, synced, width = self._holds, self._synced, self.width
        if len(tables) > self.max_seqs or any(len(t) > width for t in tables):  # before any state changes
            raise ValueError(f"{len(tables)} block tables of up to {max(map(len, tables), default=0)} entries "
                             f"for {self.max_seqs} rows of {width} (max_num_seqs, max_model_len / block_size)")
        previous_row: dict[int, int] | None = None
        moves: list[tuple[int, int]] = []
        new_synced: dict[int, int] = {}
        for i, table in enumerate(tables):
            if holds[i] is table or (not table and holds[i] is _EMPTY):
                continue
            if not table:
                new_synced[i] = -1  # write scratch into entry 0
                continue
            if previous_row is None:  # only built when the batch changed
                previous_row = {id(t): j for j, t in enumerate(holds) if t is not _EMPTY}
            j = previous_row.get(id(table))
            if j is not None and holds[j] is table:
                moves.append((j, i))
                new_synced[i] = synced[j]
            else:
                new_synced[i] = 0
        for i, count in new_synced.items():
            holds[i], synced[i] = (_EMPTY, 0) if count < 0 else (tables[i], count)
        if moves:  # one gather: the right side is read before any row is written
            k = len(moves)
            self._move_host[:2 * k] = torch.frombuffer(array.array("q", [j for j, _ in moves] + [i for _, i in moves]),
                                                       dtype=torch.int64)
            self._move[:2 * k].copy_(self._move_host[:2 * k], non_blocking=True)
            self.table[self._move[k:2 * k]] = self.table[self._move[:k]]
            self.rows_moved += k
        index, values = array.array("q"), array.array("i")
        base = self.base
        for i, count in new_synced.items():
            if count < 0:
                index.append(base + i * width)
                values.append(SCRATCH_BLOCK)
        for i, table in enumerate(tables):
            done = synced[i]
            if len(table) > done:
                index.extend(range(base + i * width + done, base + i * width + len(table)))
                values.extend(table[done:])
                synced[i] = len(table)
        self.entries_copied += len(index)
        return index, values

    def ship(self, index: array.array, values: array.array) -> None:
        """Write planned entries through this table's own staging: two copies and one index_copy_."""
        n = len(index)
        if n:
            self._index_host[:n] = torch.frombuffer(index, dtype=torch.int64)
            self._value_host[:n] = torch.frombuffer(values, dtype=torch.int32)
            self._index[:n].copy_(self._index_host[:n], non_blocking=True)
            self._value[:n].copy_(self._value_host[:n], non_blocking=True)
            self.shared.index_copy_(0, self._index[:n], self._value[:n])
