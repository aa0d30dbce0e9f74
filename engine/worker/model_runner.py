"""ModelRunner: one scheduled step -> logits of the sequences that sample.

It flattens the step's chunks into `input_ids` / `positions` and the attention metadata, written into
static buffers allocated once at the largest size and sliced per step (a graph recorded their
addresses; eager steps use the same buffers so there is one path). The dispatcher picks the mode;
FULL steps replay a native graph: a decode graph (engine.worker.decode_graphs) for a uniform decode
batch, else a mixed-step graph (engine.worker.mixed_graphs). The others run the (compiled) model under
a forward context. Apart from decode graphs (whose LM head is recorded), logits are computed only for
the last token of each sampling sequence.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from custom_ops import SCRATCH_BLOCK, AttentionMetadata, RuntimeMode, forward_context
from engine.kv.block_pool import BlockPool
from engine.worker.dispatch import BatchDescriptor, Dispatch, Dispatcher
from engine.worker.input_buffers import DeviceIds, StaticBuffers

if TYPE_CHECKING:  # the runner reads a scheduled step; it never imports the core that makes it
    from engine.step import SchedulerOutput

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepResult:
    logits: torch.Tensor   # [N, V], row i for the i-th sampling chunk (a verify chunk: 1 + its proposals rows)
    dispatch: Dispatch
    # [N, tiles] int64: the LM head's per-tile argmax keys of those logits (a decode graph whose LM
    # head stores them, engine.worker.decode_graphs), from which greedy rows need not read the logits again
    argmax_keys: torch.Tensor | None = None


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """The KV slots of positions start..end-1 onto `slots`: one range per block, not a Python step per
    token (a 512-token chunk is the host's longest loop of a prefill step)."""
    for block in range(start // block_size, (end - 1) // block_size + 1):
        first = block * block_size
        base = table[block] * block_size - first
        slots.extend(range(base + max(start, first), base + min(end, first + block_size)))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, forward: Forward, block_size: int, max_model_len: int,
                 max_tokens: int, max_seqs: int, device: torch.device,
                 mark_dynamic: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 max_logits_rows: int | None = None) -> None:
        self.model = model
        self.forward = forward
        self.mark_dynamic = mark_dynamic
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.max_seqs = max_seqs
        self.buffers = StaticBuffers(max_tokens, max_seqs, -(-max_model_len // block_size), device, max_logits_rows)
        self.dispatcher = Dispatcher()
        self.decode_graphs = None  # engine.worker.decode_graphs.DecodeGraphs, once captured
        self.mixed_graphs = None   # engine.worker.mixed_graphs.MixedGraphs (cudagraph_mode FULL), once captured
        self.verify_graphs = None  # DecodeGraphs(store_first=True): verify steps' tokens as decode rows
        self.kv_caches: dict[str, torch.Tensor] = {}  # layer name -> this engine's cache (engine.kv.kv_cache)
        self.group_layers: list[tuple[str, ...]] = []  # layers of KV groups 1.. (engine.kv.groups)
        self.scratch_slot = SCRATCH_BLOCK * block_size  # padding tokens write here, read nothing
        # Tensor parallelism (engine.distributed.tp): on rank 0, called with each staged step so the other ranks
        # stage the same buffers and run the same forward.
        self.on_staged: Callable[..., None] | None = None

    def execute(self, out: SchedulerOutput, pool: BlockPool, device_ids: DeviceIds | None = None,
                step_indices: list[int] = ()) -> StepResult:
        """`device_ids`: input ids that live on the device (engine.core.step_loop), written with the step's
        upload. `step_indices` reach `self.buffers.step_indices` in the step's one copy (valid until the
        next step is loaded)."""
        decode = out.is_uniform_decode  # (a verify step is not one: a decode step skips that scan)
        batch = BatchDescriptor(out.num_tokens, decode, not decode and out.is_verify)
        dispatch = self.dispatcher.dispatch(batch)
        full, uniform = dispatch.mode is RuntimeMode.FULL, dispatch.descriptor.uniform_decode
        meta, num_sampling = self._prepare(out, pool, dispatch.descriptor.num_tokens, full and uniform, step_indices,
                                           device_ids, mixed=full and not uniform, uniform_decode=decode)
        # a verify step under a decode graph runs every token as a sequence row of its own (_prepare)
        num_rows = batch.num_tokens if full and uniform else len(out.chunks)
        if self.on_staged is not None:  # after the upload resolved device_ids: the other ranks get real ids
            self.on_staged(batch, dispatch, meta, num_sampling, num_rows)
        return self.run_staged(dispatch, meta, num_sampling, num_rows)

    def run_staged(self, dispatch: Dispatch, meta: AttentionMetadata | None, num_sampling: int,
                   num_chunks: int) -> StepResult:
        """Run a step whose values are already in the static buffers (what every TP rank runs)."""
        full = dispatch.mode is RuntimeMode.FULL
        num_padded = dispatch.descriptor.num_tokens
        rows = self.buffers.logits_indices[:num_sampling]  # under a decode graph, a token's row is its chunk's
        if full and not dispatch.descriptor.uniform_decode:
            hidden = self.mixed_graphs.replay(num_padded)
            return StepResult(self.model.compute_logits(hidden[rows]), dispatch)
        if full:
            graphs = self.verify_graphs if dispatch.descriptor.verify else self.decode_graphs
            logits = graphs.replay(num_padded, num_chunks)
            keys = graphs.argmax_keys(num_padded, num_chunks)
            if num_sampling != num_chunks:  # a 1-token chunk short of its request's end samples nothing
                logits = logits[rows]
                keys = None if keys is None else keys[rows]
            return StepResult(logits, dispatch, keys)
        hidden = self.run_forward(meta, dispatch.mode, num_padded)
        return StepResult(self.model.compute_logits(hidden[rows]), dispatch)

    def set_kv_groups(self, groups: list) -> None:
        """The engine's KV groups (engine.kv.groups.KVGroup, group 0 first): groups after the first get
        their own slot mapping and block tables, which their layers' attention reads."""
        self.group_layers = [tuple(g.layer_names) for g in groups[1:]]
        self.buffers.set_num_groups(len(groups))

    def group_metadata(self, meta: AttentionMetadata) -> dict[str, AttentionMetadata] | None:
        """Layer name -> its group's metadata for the layers outside group 0 (None with one group)."""
        if not self.group_layers:
            return None
        return {name: group_meta for names, group_meta in zip(self.group_layers, self.buffers.group_metadata(meta))
                for name in names}

    def run_forward(self, meta: AttentionMetadata, mode: RuntimeMode, num_tokens: int) -> torch.Tensor:
        """The model over the first num_tokens buffered tokens, under the step's forward context."""
        ids, positions = self.buffers.input_ids[:num_tokens], self.buffers.positions[:num_tokens]
        if self.mark_dynamic is not None:
            self.mark_dynamic(ids, positions)
        with self.forward_context(meta, mode, num_tokens):
            return self.forward(ids, positions)

    def forward_context(self, meta: AttentionMetadata, mode: RuntimeMode, num_tokens: int):
        """The forward context of a step over this engine's buffers: its KV caches, and every KV
        group's metadata (a context without them would send sliding layers to group 0's tables)."""
        return forward_context(meta, mode, num_tokens, self.kv_caches, self.group_metadata(meta))

    def full_graph_seqs(self, dispatch: Dispatch) -> int:
        """The sequence rows a FULL step's graph reads: a decode graph one per token, a mixed graph all."""
        return dispatch.descriptor.num_tokens if dispatch.descriptor.uniform_decode else self.max_seqs

    def _prepare(self, out: SchedulerOutput, pool: BlockPool, num_padded: int,
                 full: bool, step_indices: list[int] = (),
                 device_ids: DeviceIds | None = None, mixed: bool = False,
                 uniform_decode: bool | None = None) -> tuple[AttentionMetadata | None, int]:
        """Load the step into the static buffers; (its metadata, or None under FULL, where the graph
        reads the buffer slices it was captured with; the number of sampling chunks). `full`: the
        layout of a decode graph, `mixed`: that of a mixed graph (engine.worker.mixed_graphs).
        `uniform_decode`: out.is_uniform_decode, where the caller knows it."""
        if uniform_decode is None:
            uniform_decode = out.is_uniform_decode
        if uniform_decode:
            lists = self._decode_lists(out, pool)
        else:
            lists = self._chunk_lists(out, pool, full)
        ids, positions, slots, query_start_loc, seq_lens, tables, logits_indices, group_slots, group_tables = lists
        num_extra = len(self.group_layers)
        num_tokens, num_seqs = len(ids), len(query_start_loc) - 1
        pad = num_padded - num_tokens
        ids += [0] * pad
        positions += [0] * pad
        slots += [self.scratch_slot] * pad
        for g in range(num_extra):
            group_slots[g] += [self.scratch_slot] * pad
            if full:
                group_tables[g] += [[]] * pad
        if full:
            # Padding rows are one-token sequences on the scratch block, so the captured kernels see
            # well-formed sequences and every write they make lands in scratch.
            query_start_loc += range(num_tokens + 1, num_padded + 1)
            seq_lens += [1] * pad
            tables += [[]] * pad
        if mixed:
            self._pad_mixed(query_start_loc, seq_lens, tables, group_tables)
        self.buffers.load(ids, positions, slots, query_start_loc, seq_lens, tables, logits_indices,
                          group_slots, group_tables, step_indices, device_ids)
        if full or mixed:
            return None, len(logits_indices)
        max_query_len = 1 if uniform_decode else max(c.num_tokens for c in out.chunks)
        meta = self.buffers.metadata(num_padded, num_seqs, num_tokens, max_query_len, max(seq_lens), uniform_decode)
        return meta, len(logits_indices)

    def _decode_lists(self, out: SchedulerOutput, pool: BlockPool) -> tuple:
        """_chunk_lists for a step whose every chunk is one decode token (the host's step at batch 64):
        one comprehension per list instead of a Python step per chunk and list. A token still in
        flight stages 0 (`device_ids` fills it)."""
        block_size = self.block_size
        chunks = out.chunks
        n = len(chunks)
        positions = [c.start for c in chunks]
        ids = [known[p] if p < len(known) else 0
               for known, p in zip([c.request.token_ids for c in chunks], positions)]
        blocks = [p // block_size for p in positions]
        offsets = [p % block_size for p in positions]
        tables, *group_tables = pool.tables_by_group([c.request.request_id for c in chunks])
        slots = [t[b] * block_size + o for t, b, o in zip(tables, blocks, offsets)]
        group_slots = [[t[b] * block_size + o for t, b, o in zip(group, blocks, offsets)] for group in group_tables]
        seq_lens = [p + 1 for p in positions]
        # a 1-token chunk short of its request's end (the last of a chunked prefill) samples nothing
        samples = [i for i, c in enumerate(chunks) if c.samples]
        return (ids, positions, slots, list(range(n + 1)), seq_lens, tables, samples, group_slots, group_tables)

    def _chunk_lists(self, out: SchedulerOutput, pool: BlockPool, full: bool) -> tuple:
        """The host lists of a step's rows (ids, positions, slots, query_start_loc, seq_lens, tables,
        logits_indices, and per extra KV group its slots and tables), before padding."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        block_size = self.block_size
        num_extra = len(self.group_layers)
        group_slots: list[list[int]] = [[] for _ in range(num_extra)]
        group_tables: list[list[list[int]]] = [[] for _ in range(num_extra)]
        for chunk in out.chunks:
            request, start, end = chunk.request, chunk.start, chunk.start + chunk.num_tokens
            if num_extra:
                table, *extra = pool.tables(request.request_id)
            else:
                table, extra = pool.block_table(request.request_id), ()
            known = request.token_ids  # positions past its end are in flight: `device_ids` fills them
            if full and chunk.proposals:
                # A verify chunk under a decode graph: each of its tokens is a decode row of its own,
                # attending to the keys up to its position over the request's table (the step stores
                # every token's K/V before any row attends), so the graph needs no query length.
                for j, token in enumerate((known[start], *chunk.proposals)):
                    position = start + j
                    block, offset = divmod(position, block_size)
                    ids.append(token)
                    positions.append(position)
                    slots.append(table[block] * block_size + offset)
                    for g, group_table in enumerate(extra):
                        group_slots[g].append(group_table[block] * block_size + offset)
                        group_tables[g].append(group_table)
                    query_start_loc.append(query_start_loc[-1] + 1)
                    seq_lens.append(position + 1)
                    tables.append(table)
                    logits_indices.append(query_start_loc[-1] - 1)
                continue
            if end - start == 1:  # a decode token: appends, not generators (the host's step at batch 64)
                block, offset = divmod(start, block_size)
                ids.append(known[start] if start < len(known) else 0)
                positions.append(start)
                slots.append(table[block] * block_size + offset)
                for g, group_table in enumerate(extra):
                    group_slots[g].append(group_table[block] * block_size + offset)
                    group_tables[g].append(group_table)
            else:
                if chunk.proposals:  # a verify chunk: the request's known tokens, then the proposals
                    ids.extend(known[start:end - len(chunk.proposals)])
                    ids.extend(chunk.proposals)
                else:
                    ids.extend(known[start:end])
                    if end > len(known):
                        ids.extend([0] * (end - max(start, len(known))))
                positions.extend(range(start, end))
                _extend_slots(slots, table, start, end, block_size)
                for g, group_table in enumerate(extra):
                    _extend_slots(group_slots[g], group_table, start, end, block_size)
                    group_tables[g].append(group_table)
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
            seq_lens.append(end)
            tables.append(table)
            if chunk.samples:  # the last row; a verify chunk's every row
                logits_indices.extend(range(query_start_loc[-1] - 1 - len(chunk.proposals), query_start_loc[-1]))
        return ids, positions, slots, query_start_loc, seq_lens, tables, logits_indices, group_slots, group_tables

    def _pad_mixed(self, query_start_loc: list[int], seq_lens: list[int], tables: list[list[int]],
                   group_tables: list[list[list[int]]]) -> None:
        """Extend a step's sequence rows to a mixed graph's layout (engine.worker.mixed_graphs): empty
        sequences (no query rows, no keys) up to max_num_seqs rows; the token rows past the step's
        own belong to none and are zeroed by the attention launch."""
        empty = self.max_seqs - len(seq_lens)
        query_start_loc += [query_start_loc[-1]] * empty
        seq_lens += [0] * empty
        tables += [[]] * empty
        for group in group_tables:
            group += [[]] * empty

    def mixed_metadata(self, num_tokens: int) -> AttentionMetadata:
        """The metadata a mixed graph of num_tokens records: every sequence row and token row (what
        its attention launch's grid covers); the real token count is read on the device."""
        meta = self.buffers.metadata(num_tokens, self.max_seqs, num_tokens, num_tokens, self.max_model_len, False)
        return dataclasses.replace(meta, real_tokens_on_device=True)

    def load_mixed_dummy(self, num_tokens: int) -> AttentionMetadata:
        """A mixed graph's warm-up / capture step on the scratch block only (as load_dummy): one sequence
        of up to max_model_len tokens, the rest padding, in the layout the graph replays."""
        num_real = min(num_tokens, self.max_model_len)
        query_start_loc, seq_lens, tables = [0, num_real], [num_real], [[]]
        group_tables: list[list[list[int]]] = [[[]] for _ in self.group_layers]
        self._pad_mixed(query_start_loc, seq_lens, tables, group_tables)
        self.buffers.reset_tables()  # every entry the dummy sequence reads is the scratch block
        slots = [self.scratch_slot + p % self.block_size for p in range(num_real)]
        slots += [self.scratch_slot] * (num_tokens - num_real)
        positions = list(range(num_real)) + [0] * (num_tokens - num_real)
        self.buffers.load([0] * num_tokens, positions, slots, query_start_loc, seq_lens, tables,
                          [num_real - 1], [slots] * len(self.group_layers), group_tables)
        return self.mixed_metadata(num_tokens)

    def load_dummy(self, num_tokens: int, num_seqs: int, uniform_decode: bool) -> AttentionMetadata:
        """Metadata for a warm-up or capture step that touches only the scratch block.

        The tokens are split over num_seqs sequences; every slot and block-table entry is in the
        scratch block, so it needs no KV pool beyond block 0 and never disturbs a live sequence.
        Tokens that num_seqs sequences of max_model_len cannot hold are padding, as in a padded
        real step: a bucket or token budget may exceed what max_num_seqs full-length requests fill.
        """
        if not 1 <= num_seqs <= min(num_tokens, self.max_seqs):
            raise ValueError(f"dummy step needs 1 <= num_seqs ({num_seqs}) <= num_tokens ({num_tokens}) "
                             f"and <= max_num_seqs ({self.max_seqs})")
        num_real = min(num_tokens, num_seqs * self.max_model_len)
        base, extra = divmod(num_real, num_seqs)
        lens = [base + (i < extra) for i in range(num_seqs)]
        query_start_loc = [0]
        positions: list[int] = []
        for n in lens:
            query_start_loc.append(query_start_loc[-1] + n)
            positions.extend(range(n))
        slots = [self.scratch_slot + p % self.block_size for p in positions]
        pad = num_tokens - num_real
        self.buffers.reset_tables()  # every entry the dummy sequences read is the scratch block
        slots += [self.scratch_slot] * pad
        num_extra = len(self.group_layers)
        self.buffers.load([0] * num_tokens, positions + [0] * pad, slots, query_start_loc, lens, [[]] * num_seqs,
                          [q - 1 for q in query_start_loc[1:]], [slots] * num_extra, [[[]] * num_seqs] * num_extra)
        max_seq_len = self.max_model_len if uniform_decode else max(lens)
        return self.buffers.metadata(num_tokens, num_seqs, num_real, max(lens), max_seq_len, uniform_decode)
