"""The static input buffers of a step: every tensor a step reads, at fixed device addresses (a graph
recorded them), filled from host lists through one pinned staging slab in one copy."""
from __future__ import annotations

import array
import dataclasses
from dataclasses import dataclass

import torch

from custom_ops import SCRATCH_BLOCK, AttentionMetadata
from engine.kv.block_tables import PersistentBlockTables

# Host lists reach the staging tensors through array.array + torch.frombuffer: torch.tensor(list)
# costs ~100 ns per int. Block tables are not re-sent each step: PersistentBlockTables copies only
# their new entries, so the host path does not grow with context length.
_TYPECODES = {torch.int64: "q", torch.int32: "i"}  # "i" is 32-bit wherever torch runs


@dataclass(frozen=True)
class DeviceIds:
    """Input ids that live on the device: the id of token row rows[i] is tokens[slots[i]] (engine.core.step_loop's
    sampled tokens, not read back yet when the step that consumes them is launched)."""
    tokens: torch.Tensor  # int64, on the buffers' device
    rows: list[int]
    slots: list[int]


class StaticBuffers:
    """Every tensor a step reads, at fixed device addresses, plus pinned host staging for the copies.

    The per-step values live in one int64 slab (the int32 ones in a stretch of it viewed as int32),
    mirrored by one pinned host slab, so a step's values reach the device in ONE copy: a copy per
    tensor was six to eight small transfers per step, each a few microseconds on the stream between
    two steps' graphs. The slab's order puts the short per-sequence regions first, then the
    per-token ones; a step copies from the start to the end of its last used token.

    Block tables are not re-sent (PersistentBlockTables: only their new entries), and every KV group's
    tables live in one device tensor: a decode step's new entries (at most one per row and group)
    ride in the slab too, and land with ONE index_copy_ for all groups. Apart, they were two more
    copies and a kernel per group, on the stream between two decode graphs (gemma-3-1b, two groups,
    batch 16: ~13 us of a ~55 us gap between replays on an H100). A step with more new entries than
    the slab's share (a prefill) sends them through each table's own staging.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 max_logits_rows: int | None = None) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks_per_seq = max_tokens, max_seqs, max_blocks_per_seq
        # rows a step computes logits for: one per sequence, or 1 + k per sequence verifying k proposals
        self.max_logits_rows = max_logits_rows or max_seqs
        self._pin, self._device = device.type == "cuda", device
        self._lay_out(num_groups=1)
        self._loaded = False
        self.table_entries_in_slab = 0    # block-table entries that rode the step's one copy
        self.table_entries_apart = 0      # ... and those of steps with more than fit (prefills)
        # Marks when the last step's host -> device copy has run, so the next step does not
        # overwrite pinned staging memory that an asynchronous copy is still reading.
        self._copied = torch.cuda.Event() if self._pin else None

    def _lay_out(self, num_groups: int) -> None:
        """The slabs and the (device view, host view) pair of every per-step tensor."""
        tokens, seqs, width = self.max_tokens, self.max_seqs, self.max_blocks_per_seq
        self._all_tables = torch.full((num_groups * seqs * width,), SCRATCH_BLOCK, dtype=torch.int32,
                                      device=self._device)
        self.tables, *self.group_tables = [
            PersistentBlockTables(seqs, width, self._device, self._pin, shared=self._all_tables, base=g * seqs * width)
            for g in range(num_groups)]
        self.block_tables = self.tables.table
        # A decode step adds at most one entry per row and group; twice that leaves room for rows
        # that changed hands (a padding row's scratch entry, a new decode's table).
        self._table_capacity = 2 * seqs * num_groups
        # query_start_loc [seqs + 1] and seq_lens [seqs], int32, fill seqs + 1 int64 words; the table
        # entries' int32 values fill capacity / 2 words
        regions = [("logits_indices", self.max_logits_rows), ("int32", seqs + 1), ("step_indices", seqs),
                   ("table_index", self._table_capacity),
                   ("table_value", self._table_capacity // 2), ("input_ids", tokens), ("positions", tokens),
                   ("slot_mapping", tokens)] + [(f"group_slots_{g}", tokens) for g in range(1, num_groups)]
        total = sum(n for _, n in regions)
        self._slab = torch.zeros(total, dtype=torch.int64, device=self._device)
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=self._pin)
        # the same bytes as a memoryview: a host list lands in its region with one slice assignment of
        # its array's bytes (0.8 us on the CPU box against 3.1 us for a torch slice copy; 9-10 a step)
        self._host_bytes = memoryview(self._host.numpy()).cast("B")
        views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._offsets: dict[str, int] = {}  # where each region starts in the slab (the upload kernel's ranges)
        offset = 0
        for name, n in regions:
            views[name] = (self._slab[offset:offset + n], self._host[offset:offset + n])
            self._offsets[name] = offset
            offset += n
        self._last_region = total - tokens  # a per-token region: a step fills its first len(slots)
        dev32, host32 = (v.view(torch.int32) for v in views.pop("int32"))
        self.query_start_loc, self._query_start_loc = dev32[:seqs + 1], host32[:seqs + 1]
        self.seq_lens, self._seq_lens = dev32[seqs + 1:2 * seqs + 1], host32[seqs + 1:2 * seqs + 1]
        self.logits_indices, self._logits_indices = views.pop("logits_indices")
        self.input_ids, self._input_ids = views.pop("input_ids")
        self.positions, self._positions = views.pop("positions")
        self.slot_mapping, self._slot_mapping = views.pop("slot_mapping")
        self._table_index, self._table_index_host = views.pop("table_index")
        # a per-sequence index list of the caller's (engine.core.step_loop: the slots its sampled tokens go to)
        self.step_indices, self._step_indices = views.pop("step_indices")
        self._table_value, self._table_value_host = (v.view(torch.int32) for v in views.pop("table_value"))
        # KV groups after the first (engine.kv.groups): each its own slot mapping (and block tables)
        self.group_slot_mappings = [views.pop(f"group_slots_{g}") for g in range(1, num_groups)]

    def set_num_groups(self, num_groups: int) -> None:
        """Buffers for KV groups 1..num_groups-1 (group 0 uses slot_mapping and tables). Before the
        first step: the slab is laid out again, and a graph keeps the addresses it recorded."""
        if self._loaded:
            raise RuntimeError("StaticBuffers.set_num_groups after a step was loaded: the buffers' "
                               "addresses are fixed once a step has read them")
        self._lay_out(num_groups)

    def reset_tables(self) -> None:
        for tables in (self.tables, *self.group_tables):
            tables.reset()

    def load(self, ids: list[int], positions: list[int], slots: list[int], query_start_loc: list[int],
             seq_lens: list[int], tables: list[list[int]], logits_indices: list[int],
             group_slots: list[list[int]] = (), group_tables: list[list[list[int]]] = (),
             step_indices: list[int] = (), device_ids: DeviceIds | None = None) -> None:
        """Copy one step's values in (host lists -> pinned staging -> device, asynchronously).

        `tables[i]` is the block table of sequence i: the pool's own list (only new entries are copied,
        see PersistentBlockTables), or an empty one for a padding row. `group_slots[g]` and
        `group_tables[g]`: the same for KV group g + 1 (one entry per extra group, engine.kv.groups).
        `step_indices`: up to max_seqs ints the caller reads from `self.step_indices` (same copy).
        `device_ids`: input ids that are on the device, not in `ids` (DeviceIds).

        On CUDA the copy is one kernel (custom_ops.step_upload) that also writes the new table entries
        and the device ids: one launch on the stream between two decode graphs where a copy, an
        index_copy_ and an index_select were three, with a hand-off of a few microseconds each.
        Every step takes it, mixed ones too,
        so one path serves CUDA; the torch ops below serve the CPU.
        """
        if len(group_slots) != len(self.group_tables) or len(group_tables) != len(self.group_tables):
            raise ValueError(f"StaticBuffers.load got slots / tables for {len(group_slots)} / {len(group_tables)} "
                             f"extra KV groups, the engine has {len(self.group_tables)}")
        staged = [("input_ids", self._input_ids, ids), ("positions", self._positions, positions),
                  ("slot_mapping", self._slot_mapping, slots), ("query_start_loc", self._query_start_loc, query_start_loc),
                  ("seq_lens", self._seq_lens, seq_lens), ("logits_indices", self._logits_indices, logits_indices),
                  ("step indices", self._step_indices, step_indices)]
        staged += [(f"group {g + 1} slots", host_buf, values)
                   for g, ((_, host_buf), values) in enumerate(zip(self.group_slot_mappings, group_slots))]
        for name, host_buf, values in staged:  # before anything changes: a refused step leaves no trace
            if len(values) > host_buf.numel():
                limit = " (max_num_seqs)" if name == "step indices" else ""
                raise ValueError(f"StaticBuffers.load got {len(values)} {name}; the buffers hold {host_buf.numel()}{limit}")
        if self._copied is not None:
            self._copied.synchronize()
        planned = [persistent.plan(group) for persistent, group in zip((self.tables, *self.group_tables),
                                                                          (tables, *group_tables))]
        num_entries = sum(len(index) for index, _ in planned)
        in_slab = num_entries <= self._table_capacity
        if in_slab:
            self.table_entries_in_slab += num_entries
        else:
            self.table_entries_apart += num_entries
            for persistent, (index, values) in zip((self.tables, *self.group_tables), planned):
                persistent.ship(index, values)
        self._loaded = True
        if device_ids is not None and device_ids.rows:
            ids = list(ids)
            for row, slot in zip(device_ids.rows, device_ids.slots):
                ids[row] = -1 - slot  # resolved on the device: the token in device_ids.tokens[slot]
            staged[0] = ("input_ids", self._input_ids, ids)
        else:
            device_ids = None
        for _, host_buf, values in staged:
            if values:
                self._stage(host_buf, 0, array.array(_TYPECODES[host_buf.dtype], values))
        if in_slab and num_entries:
            at = 0
            for index, values in planned:
                if index:
                    self._stage(self._table_index_host, at, index)
                    self._stage(self._table_value_host, at, values)
                    at += len(index)
        # one copy: everything up to the last used token of the last per-token region
        end = self._last_region + len(slots)
        entries = num_entries if in_slab else 0  # after the rows that moved (plan): a new entry lands on its row
        if self._pin:
            from custom_ops.step_upload import upload_step  # lazy: Triton is imported only where it runs
            ids_at = self._offsets["input_ids"]
            upload_step(self._host[:end], self._slab[:end],
                        None if device_ids is None else (ids_at, ids_at + len(ids)),
                        None if device_ids is None else device_ids.tokens, self._all_tables,
                        (self._offsets["table_index"], 2 * self._offsets["table_value"], entries),
                        check=False)  # the slabs are this object's own, pinned and on the device since _lay_out
            self._copied.record()
            return
        self._slab[:end].copy_(self._host[:end])
        if entries:
            self._all_tables.index_copy_(0, self._table_index[:entries], self._table_value[:entries])
        if device_ids is not None:
            staged_ids = self.input_ids[:len(ids)]
            staged_ids.copy_(torch.where(staged_ids < 0, device_ids.tokens[(-1 - staged_ids).clamp(min=0)],
                                         staged_ids))

    def _stage(self, host_buf: torch.Tensor, at: int, values: array.array) -> None:
        """values into host_buf[at:] (a view of the host slab, of the values' item size). Unchecked: load
        checked every list's length against its region first, and the table entries are in_slab's."""
        start = host_buf.data_ptr() - self._host.data_ptr() + at * values.itemsize
        self._host_bytes[start:start + len(values) * values.itemsize] = memoryview(values).cast("B")

    def metadata(self, num_tokens: int, num_seqs: int, num_actual_tokens: int, max_query_len: int,
                 max_seq_len: int, uniform_decode: bool) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[:num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            num_actual_tokens=num_actual_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            is_uniform_decode=uniform_decode,
        )

    def group_metadata(self, meta: AttentionMetadata) -> list[AttentionMetadata]:
        """`meta` for each KV group after the first: the same step, that group's slots and tables."""
        num_tokens, num_seqs = int(meta.slot_mapping.shape[0]), meta.num_seqs
        return [dataclasses.replace(meta, slot_mapping=slots[:num_tokens], block_tables=tables.table[:num_seqs])
                for (slots, _), tables in zip(self.group_slot_mappings, self.group_tables)]
