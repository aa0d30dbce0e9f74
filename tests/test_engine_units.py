"""Engine units on the CPU: block pool, scheduler (budget, chunking, preemption, finish reasons),
dispatch table, config validation, sampler. No model: requests and token ids only."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from custom_ops import SCRATCH_BLOCK, RuntimeMode
from engine.config import ConfigError, EngineConfig, default_decode_graph_sizes
from engine.core.scheduler import Scheduler
from engine.kv.block_pool import BlockPool
from engine.params import InvalidRequestError, SamplingParams, check_prompt
from engine.request import FinishReason, Request
from engine.sample.sampler import Sampler
from engine.worker.dispatch import BatchDescriptor, Dispatcher
from engine.worker.input_buffers import StaticBuffers

EOS = 2


def _request(rid: str, prompt_len: int, max_tokens: int = 4, **params) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params))


def _scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 16,
               max_model_len: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, block_size), max_num_seqs, budget, max_model_len, (EOS,))


def _run_step(scheduler: Scheduler, token: int = 7):
    """Schedule one step and feed back `token` for every sampling chunk."""
    out = scheduler.schedule()
    sampled = [token for c in out.chunks if c.samples]
    finished = scheduler.update(out, sampled, now=0.0)
    return out, finished


# -- block pool -----------------------------------------------------------------------------------

def test_block_pool_never_hands_out_the_scratch_block():
    pool = BlockPool(5, 4)
    assert pool.grow("a", 16)  # 4 blocks: every usable one
    assert SCRATCH_BLOCK not in pool.block_table("a")
    assert pool.num_free_blocks == 0
    assert not pool.grow("b", 1)


def test_block_pool_grows_by_whole_blocks_and_frees_everything():
    pool = BlockPool(10, 4)
    assert pool.grow("a", 5) and len(pool.block_table("a")) == 2
    assert pool.grow("a", 8) and len(pool.block_table("a")) == 2  # still fits
    assert pool.grow("a", 9) and len(pool.block_table("a")) == 3
    table = pool.block_table("a")
    assert pool.slot("a", 5) == table[1] * 4 + 1
    assert pool.free("a") == 3 and pool.num_free_blocks == 9


def test_block_pool_refuses_without_partial_allocation():
    pool = BlockPool(4, 4)
    assert pool.grow("a", 8)
    assert not pool.grow("b", 8)  # needs 2, only 1 free
    assert pool.block_table("b") == [] and pool.num_free_blocks == 1


def test_static_buffers_load_copies_the_values_and_keeps_block_table_rows_between_steps():
    buffers = StaticBuffers(max_tokens=8, max_seqs=3, max_blocks_per_seq=4, device=torch.device("cpu"))
    first, second = [1], [7, 8, 9]
    buffers.load([5, 6, 7], [0, 1, 9], [4, 5, 39], [0, 2, 3], [2, 10], [first, second], [1, 2])
    assert buffers.input_ids[:3].tolist() == [5, 6, 7] and buffers.positions[:3].tolist() == [0, 1, 9]
    assert buffers.slot_mapping[:3].tolist() == [4, 5, 39] and buffers.logits_indices[:2].tolist() == [1, 2]
    assert buffers.query_start_loc[:3].tolist() == [0, 2, 3] and buffers.seq_lens[:2].tolist() == [2, 10]
    assert buffers.block_tables[:2].tolist() == [[1, 0, 0, 0], [7, 8, 9, 0]] and SCRATCH_BLOCK == 0
    assert buffers.block_tables.dtype == torch.int32 and buffers.slot_mapping.dtype == torch.int64
    # Next step: the first sequence is gone, the second grew a block, a padding row follows.
    second.append(11)
    copied = buffers.tables.entries_copied
    buffers.load([1, 0], [13, 0], [44, 0], [0, 1, 2], [14, 1], [second, []], [0])
    assert buffers.block_tables[0].tolist() == [7, 8, 9, 11] and int(buffers.block_tables[1, 0]) == SCRATCH_BLOCK
    # the moved row came over on the device; only the new entry and the padding row's scratch were sent
    assert buffers.tables.rows_moved == 1 and buffers.tables.entries_copied - copied == 2


def test_static_buffers_refuse_a_list_longer_than_its_staging_region():
    """The host lists land in the pinned slab by byte offset: one longer than its region would overwrite
    the next region's values, so it is an error naming the list and the sizes, raised before anything
    changes (the block tables' bookkeeping included): the next step loads as if it never came."""
    buffers = StaticBuffers(max_tokens=8, max_seqs=3, max_blocks_per_seq=4, device=torch.device("cpu"))
    buffers.load([5, 6, 7], [0, 1, 9], [4, 5, 39], [0, 2, 3], [2, 10], [[1], [7]], [1, 2])
    with pytest.raises(ValueError, match="got 4 logits_indices; the buffers hold 3"):
        buffers.load([1], [2], [3], [0, 1], [3], [[1, 2, 3]], [0, 1, 2, 3])  # 4 logits rows, room for 3
    with pytest.raises(ValueError, match="got 9 input_ids; the buffers hold 8"):
        buffers.load([1] * 9, [2] * 9, [3] * 9, [0, 9], [9], [[1, 2, 3]], [8])
    buffers.load([9, 8], [4, 5], [6, 7], [0, 1, 2], [5, 6], [[1, 4], [7]], [0, 1])
    assert buffers.positions[:2].tolist() == [4, 5] and buffers.logits_indices[:2].tolist() == [0, 1]
    assert buffers.block_tables[:2].tolist() == [[1, 4, 0, 0], [7, 0, 0, 0]]


def test_static_buffers_send_a_steps_values_in_one_copy_and_keep_their_addresses():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        """Copies into the device-side buffers (on the CPU both sides are CPU tensors; the staging
        writes into the host slab are host work on a GPU too)."""
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() == device_slab:
                CountCopies.copies += 1
            return func(*args, **(kwargs or {}))

    buffers = StaticBuffers(max_tokens=8, max_seqs=3, max_blocks_per_seq=4, device=torch.device("cpu"))
    buffers.set_num_groups(2)  # Gemma 3: a second KV group with its own slot mapping
    device_slab = buffers.input_ids.untyped_storage().data_ptr()
    addresses = [t.data_ptr() for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping,
                                        buffers.query_start_loc, buffers.seq_lens, buffers.logits_indices,
                                        buffers.group_slot_mappings[0][0])]
    table = [3]
    buffers.load([5, 6], [0, 1], [12, 13], [0, 2], [2], [table], [1], [[20, 21]], [[table]])
    with CountCopies():  # tables unchanged; the overlapped loop's gather / scatter indices ride along
        buffers.load([9], [2], [14], [0, 1], [3], [table], [0], [[22]], [[table]], step_indices=[0, 4, 5])
    assert CountCopies.copies == 1 and buffers.step_indices[:3].tolist() == [0, 4, 5]
    assert buffers.input_ids[:1].tolist() == [9] and buffers.positions[:1].tolist() == [2]
    assert buffers.slot_mapping[:1].tolist() == [14] and buffers.group_slot_mappings[0][0][:1].tolist() == [22]
    assert buffers.query_start_loc[:2].tolist() == [0, 1] and buffers.seq_lens[:1].tolist() == [3]
    assert buffers.logits_indices[:1].tolist() == [0] and buffers.query_start_loc.dtype == torch.int32
    assert addresses == [t.data_ptr() for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping,
                                                buffers.query_start_loc, buffers.seq_lens, buffers.logits_indices,
                                                buffers.group_slot_mappings[0][0])]
    with pytest.raises(RuntimeError, match="set_num_groups after a step was loaded"):
        buffers.set_num_groups(3)
    with pytest.raises(ValueError, match=r"4 step indices; the buffers hold 3 \(max_num_seqs\)"):
        buffers.load([9], [2], [14], [0, 1], [3], [table], [0], [[22]], [[table]], step_indices=list(range(4)))


def test_a_decode_steps_new_block_table_entries_ride_the_one_copy_and_land_in_one_kernel():
    """Both KV groups' tables grow a block (a decode crossing a block boundary): the step is still one
    copy into the device buffers and one index_copy_ for both groups' new entries; a step with more
    new entries than the slab holds (a long prefill) sends them apart, and every row ends up right."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        slab_copies = table_writes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            storage = args[0].untyped_storage().data_ptr() if args and isinstance(args[0], torch.Tensor) else None
            if func is torch.ops.aten.copy_.default and storage == device_slab:
                Count.slab_copies += 1
            if func is torch.ops.aten.index_copy_.default:
                Count.table_writes += 1
            return func(*args, **(kwargs or {}))

    buffers = StaticBuffers(max_tokens=64, max_seqs=2, max_blocks_per_seq=24, device=torch.device("cpu"))
    buffers.set_num_groups(2)
    device_slab = buffers.input_ids.untyped_storage().data_ptr()
    full, window = [3, 4], [5, 6]
    buffers.load([1, 2], [30, 30], [0, 0], [0, 1, 2], [31, 31], [full, []], [0, 1], [[0, 0]], [[window, []]])
    full.append(7)
    window.append(8)
    with Count():
        buffers.load([1, 2], [31, 0], [0, 0], [0, 1, 2], [32, 1], [full, []], [0, 1], [[0, 0]], [[window, []]])
    assert (Count.slab_copies, Count.table_writes) == (1, 1)
    assert buffers.block_tables[0, :3].tolist() == [3, 4, 7]
    assert buffers.group_tables[0].table[0, :3].tolist() == [5, 6, 8]
    assert buffers.table_entries_apart == 0 and buffers.table_entries_in_slab == (2 + 2) + (1 + 1)
    long_prompt = list(range(10, 30))  # 20 new entries in one step: more than 2 * 2 seqs * 2 groups
    buffers.load([1], [0], [0], [0, 1], [1], [long_prompt, []], [0], [[0]], [[[9], []]])
    assert buffers.block_tables[0, :20].tolist() == long_prompt and int(buffers.group_tables[0].table[0, 0]) == 9
    assert buffers.table_entries_apart == 21 and int(buffers.block_tables[1, 0]) == SCRATCH_BLOCK


# -- scheduler ------------------------------------------------------------------------------------

def test_prefill_is_chunked_to_the_token_budget():
    scheduler = _scheduler(budget=8)
    request = _request("a", 20)
    scheduler.add(request)
    sizes = []
    for _ in range(3):
        out, _ = _run_step(scheduler)
        sizes.append([(c.start, c.num_tokens, c.samples) for c in out.chunks])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert request.output_token_ids == [7]


def test_decodes_and_prefill_chunks_share_the_budget():
    scheduler = _scheduler(budget=10)
    first = _request("a", 3, max_tokens=10)
    scheduler.add(first)
    _run_step(scheduler)  # a: prefill of 3, samples
    scheduler.add(_request("b", 30))
    out, _ = _run_step(scheduler)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    assert out.num_tokens == 10 and not out.is_uniform_decode


def test_uniform_decode_batch_after_prefills():
    scheduler = _scheduler(budget=64)
    for i in range(3):
        scheduler.add(_request(str(i), 5 + i, max_tokens=5))
    _run_step(scheduler)
    out, _ = _run_step(scheduler)
    assert out.is_uniform_decode and out.num_tokens == 3


def test_max_num_seqs_limits_admission():
    scheduler = _scheduler(max_num_seqs=2, budget=64)
    for i in range(3):
        scheduler.add(_request(str(i), 4))
    out, _ = _run_step(scheduler)
    assert len(out.chunks) == 2 and len(scheduler.waiting) == 1


def test_finish_on_max_tokens():
    scheduler = _scheduler()
    request = _request("a", 3, max_tokens=3)
    scheduler.add(request)
    for _ in range(3):
        _, finished = _run_step(scheduler)
    assert finished == [request] and request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [7, 7, 7]
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_usable_blocks


def test_finish_on_eos_unless_ignored():
    scheduler = _scheduler()
    stops, ignores = _request("a", 3, max_tokens=5), _request("b", 3, max_tokens=2, ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(ignores)
    _, finished = _run_step(scheduler, token=EOS)
    assert finished == [stops] and stops.finish_reason is FinishReason.EOS
    _, finished = _run_step(scheduler, token=EOS)
    assert finished == [ignores] and ignores.finish_reason is FinishReason.LENGTH
    assert ignores.output_token_ids == [EOS, EOS]


def test_finish_on_stop_token_ids():
    scheduler = _scheduler()
    request = _request("a", 3, max_tokens=5, stop_token_ids=(9,))
    scheduler.add(request)
    _run_step(scheduler, token=7)
    _, finished = _run_step(scheduler, token=9)
    assert finished == [request] and request.finish_reason is FinishReason.STOP
    assert request.output_token_ids == [7, 9]


def test_finish_at_max_model_len():
    scheduler = _scheduler(max_model_len=8)
    request = _request("a", 6, max_tokens=100)
    scheduler.add(request)
    for _ in range(2):
        _, finished = _run_step(scheduler)
    assert finished == [request] and request.finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 8


def test_preemption_takes_the_newest_and_recomputes_everything_it_had():
    # 6 usable blocks of 4 tokens: two requests of 8 prompt tokens fill 4, decoding grows them
    # until the pool runs dry and the newer one is preempted.
    scheduler = _scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24)
    old, new = _request("old", 8, max_tokens=12), _request("new", 8, max_tokens=12)
    scheduler.add(old)
    scheduler.add(new)
    preempted_at, resumed = None, None
    for step in range(40):
        out, _ = _run_step(scheduler, token=100 + step)
        if out.preempted and preempted_at is None:
            preempted_at = step
            assert out.preempted == [new]
            assert new.num_computed_tokens == 0 and new.status.value == "waiting"
            assert scheduler.waiting[0] is new
            tokens_at_preemption = list(new.token_ids)
        elif preempted_at is not None and resumed is None:
            resumed = next((c for c in out.chunks if c.request is new), None)
        if old.is_finished and new.is_finished:
            break
    # On readmission the whole token list (prompt + generated) is recomputed in one chunk, which samples.
    assert resumed is not None and (resumed.start, resumed.num_tokens) == (0, len(tokens_at_preemption))
    assert resumed.samples
    assert preempted_at is not None
    assert old.is_finished and new.is_finished
    assert new.token_ids[:len(tokens_at_preemption)] == tokens_at_preemption  # nothing lost
    assert len(new.output_token_ids) == 12 and len(old.output_token_ids) == 12
    assert new.num_preemptions >= 1 and scheduler.num_preemptions >= 1
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_usable_blocks


def test_scheduler_rejects_a_pool_smaller_than_one_request():
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(BlockPool(4, 4), 4, 16, 64)


# -- dispatch -------------------------------------------------------------------------------------

def test_dispatch_pads_decode_to_the_bucket_and_prefill_to_the_piece_size():
    dispatcher = Dispatcher((1, 2, 4, 8), (16, 64), decode_graphs_wanted=True, piecewise_graphs_wanted=True)
    full = dispatcher.dispatch(BatchDescriptor(3, True))
    assert full.mode is RuntimeMode.FULL and full.descriptor == BatchDescriptor(4, True)
    piece = dispatcher.dispatch(BatchDescriptor(17, False))
    assert piece.mode is RuntimeMode.PIECEWISE and piece.descriptor.num_tokens == 64
    none = dispatcher.dispatch(BatchDescriptor(65, False))
    assert none.mode is RuntimeMode.NONE and none.descriptor.num_tokens == 65


def test_dispatch_counts_fallbacks_and_logs_each_reason_once(caplog):
    dispatcher = Dispatcher((1, 2), (), decode_graphs_wanted=True)
    with caplog.at_level(logging.WARNING, logger="engine"):
        for _ in range(3):
            assert dispatcher.dispatch(BatchDescriptor(5, True)).mode is RuntimeMode.NONE
        assert dispatcher.dispatch(BatchDescriptor(9, False)).mode is RuntimeMode.NONE  # not a fallback
    assert dispatcher.fallbacks == 3
    assert len([r for r in caplog.records if "no CUDA graph" in r.message]) == 1


def test_dispatch_logs_one_line_per_kind_of_fallback_whatever_the_sizes(caplog):
    dispatcher = Dispatcher((1, 2), (4, 8), decode_graphs_wanted=True, piecewise_graphs_wanted=True)
    with caplog.at_level(logging.WARNING, logger="engine"):
        for n in (5, 6, 7):  # decode batches past the largest decode graph: PIECEWISE instead
            assert dispatcher.dispatch(BatchDescriptor(n, True)).mode is RuntimeMode.PIECEWISE
        for n in (9, 10):
            assert dispatcher.dispatch(BatchDescriptor(n, False)).mode is RuntimeMode.NONE
    assert dispatcher.fallbacks == 5 and len(dispatcher.fallback_counts) == 5
    assert len([r for r in caplog.records if "no CUDA graph" in r.message]) == 2


def test_dispatch_without_graphs_runs_everything_unpadded():
    dispatcher = Dispatcher()
    for batch in (BatchDescriptor(1, True), BatchDescriptor(100, False)):
        result = dispatcher.dispatch(batch)
        assert result.mode is RuntimeMode.NONE and result.descriptor == batch
    assert dispatcher.fallbacks == 0


# -- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("block_size", 1.5), ("dtype", "float64"),
    ("device", "tpu"), ("kv_memory_fraction", 1.5), ("num_gpu_blocks", 1), ("piece_compiler", "tvm"),
    ("decode_graph_sizes", (0, 4)), ("decode_graph_sizes", (64,)), ("prefill_graph_sizes", (4096,)),
    ("disable_custom_all_reduce", "yes"), ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.2),
    ("gpu_memory_utilization", True),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_config_on_cpu_ignores_graph_options_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="engine"):
        config = EngineConfig(device="cpu", cuda_graphs=True, prefill_graphs=True).resolve(2048)
    assert not config.cuda_graphs and not config.prefill_graphs and config.dtype == "float32"
    assert len(caplog.records) == 1 and "ignored" in caplog.records[0].message


def test_config_default_decode_sizes_end_at_max_num_seqs():
    assert default_decode_graph_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_decode_graph_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    # no decode batch exceeds the token budget: no graph is captured past it
    assert EngineConfig(device="cpu", max_num_seqs=64, max_num_batched_tokens=20).resolve().decode_graph_sizes[-1] == 20
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineConfig(device="cpu", max_model_len=9000).resolve(8192)


# -- sampling params and sampler ------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", "8"), ("temperature", -0.5), ("temperature", float("nan")), ("top_k", -2),
    ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.5), ("seed", -3), ("stop_token_ids", (5, -1)), ("stop", ("",)),
    ("stop", 5), ("stop", ["ok", None]), ("ignore_eos", 1), ("logprobs", 21), ("min_p", -0.1),
    ("min_tokens", 17), ("logit_bias", {5: 100.5}), ("presence_penalty", 3),
])
def test_sampling_params_refuse_an_invalid_value_when_made_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=rf"^SamplingParams\.{field}=.* is invalid: expected") as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize("field,value", [("stop_token_ids", (5, 1000)), ("logit_bias", {100: 1.0})])
def test_sampling_params_token_ids_are_checked_against_the_vocabulary_naming_request_and_field(field, value):
    params = SamplingParams(**{field: value})  # any int >= 0 is a token id until a model says otherwise
    params.check("r7", vocab_size=1001)
    with pytest.raises(InvalidRequestError, match=rf"request 'r7': SamplingParams.{field}") as info:
        params.check("r7", vocab_size=100)
    assert info.value.param == field


@pytest.mark.parametrize("stop,expected", [(None, ()), ("END", ("END",)), (["a", "b"], ("a", "b")),
                                           (("a",), ("a",)), ([], ())])
def test_sampling_params_stop_takes_none_a_string_or_a_list_as_vllm(stop, expected):
    params = SamplingParams(stop=stop)
    assert params.stop == expected
    hash(params)  # a list would make the frozen dataclass unhashable


def test_sampling_params_max_tokens_none_means_no_bound_of_its_own_as_vllm():
    params = SamplingParams(max_tokens=None, min_tokens=10_000)  # min_tokens has no max_tokens to stay under
    assert params.max_tokens is None
    hash(params)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=-1)
    with pytest.raises(InvalidRequestError, match=r"max_tokens=0 is invalid: expected an int >= 1, or None"):
        SamplingParams(max_tokens=0)


def test_gpu_memory_utilization_bounds_everything_the_engine_holds_as_vllm():
    """The KV pool's share under vLLM's gpu_memory_utilization: total x share, less what is in use
    (weights, graphs) and what the warm-up peak and later captures reserve; never more than is free."""
    from engine.worker.graphs_and_pool import kv_pool_spare_bytes
    gib = 2**30
    # 80 GiB GPU, 8 GiB in use (weights), 2 GiB reserved: 0.5 -> 40 - 8 - 2 = 30 GiB
    assert kv_pool_spare_bytes(72 * gib, 80 * gib, 2 * gib, 0.5) == 30 * gib
    # another process holds 30 GiB too: free 42 GiB; 0.9 -> 72 - 38 - 2 = 32 GiB (not the 40 left free)
    assert kv_pool_spare_bytes(42 * gib, 80 * gib, 2 * gib, 0.9) == 32 * gib
    assert kv_pool_spare_bytes(72 * gib, 80 * gib, 2 * gib, None) == 70 * gib  # kv_memory_fraction's base
    assert kv_pool_spare_bytes(72 * gib, 80 * gib, 2 * gib, 0.1) < 0  # weights alone exceed the share
    assert EngineConfig(gpu_memory_utilization=0.85).gpu_memory_utilization == 0.85


def test_sampling_params_n_is_one_and_more_is_refused_saying_what_to_do():
    assert SamplingParams(n=1).n == 1
    with pytest.raises(InvalidRequestError, match=r"SamplingParams.n=4 is invalid: expected 1: LLM.generate "
                                                  r"gives one completion per prompt; for n samples pass"):
        SamplingParams(n=4)


def test_request_output_has_vllms_outputs_view():
    from engine.outputs import RequestOutput
    out = RequestOutput("r", [1, 2], [5, 6], "hi there", True, "eos", 0.01)
    [completion] = out.outputs
    assert (completion.index, completion.text, completion.token_ids, completion.logprobs) == (0, "hi there", [5, 6], None)
    assert completion.finish_reason == "stop"  # vLLM calls an EOS "stop"
    assert RequestOutput("r", [1], [5], "x", True, "length", 0.01).outputs[0].finish_reason == "length"


def test_sampling_params_take_vllm_spellings_of_off_and_none():
    params = SamplingParams(top_k=-1, stop_token_ids=None, logit_bias=None)
    assert (params.top_k, params.stop_token_ids, params.logit_bias) == (0, (), ())
    listed = SamplingParams(stop_token_ids=[3, 4], logit_bias={7: -1.5})
    assert listed.stop_token_ids == (3, 4) and listed.logit_bias == ((7, -1.5),)
    assert dataclasses.replace(listed, max_tokens=3).stop_token_ids == (3, 4)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        dataclasses.replace(listed, max_tokens=0)  # replace() re-validates


@pytest.mark.parametrize("prompt,message", [
    ([1, True, 3], "must be ints"),                 # a bool is not a token id
    ([1, 2.0, 3], "must be ints"),
    ([1, "2"], "must be ints"),
    ([5, 99, 100, -1, 7, 250, 101, 300], r"\[100, -1, 250, 101, 300\] are outside the vocabulary \[0, 100\)"),
    (list(range(1, 90)), "89 tokens, longer than max_model_len \\(64\\)"),
])
def test_check_prompt_names_the_request_and_what_is_wrong(prompt, message):
    with pytest.raises(InvalidRequestError, match=rf"request 'r7': .*{message}"):
        check_prompt("r7", prompt, vocab_size=100, max_model_len=64)


def test_check_prompt_returns_a_fresh_list_of_plain_ints():
    class Id(int):
        pass

    caller = [3, 0, 99]
    for prompt in (caller, tuple(caller), torch.tensor(caller), [Id(3), 0, Id(99)]):
        ids = check_prompt("r", prompt, vocab_size=100, max_model_len=64)
        assert ids == caller and ids is not caller and all(type(t) is int for t in ids)


def _sampling_request(rid: str, **params) -> Request:
    return Request(rid, [1], SamplingParams(**params))


def test_sampler_greedy_is_argmax():
    logits = torch.randn(3, 50)
    requests = [_sampling_request(str(i)) for i in range(3)]
    assert Sampler(torch.device("cpu"), 0)(logits, requests) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-45, 1e-6, 9.99e-6])
def test_a_temperature_below_1e_minus_5_is_greedy(temperature):
    """vLLM's rule: dividing logits by 1e-45 overflows to inf/nan and sampled token 0 every step."""
    params = SamplingParams(temperature=temperature, seed=3)
    params.check("r", vocab_size=50)
    assert params.temperature == 0.0
    logits = torch.randn(4, 50) * 3
    requests = [Request(str(i), [1], params) for i in range(4)]
    sampler = Sampler(torch.device("cpu"), 0)
    for r in requests:
        sampler.attach(r)
    assert sampler(logits, requests) == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # from 1e-5 on it samples


def test_same_seed_same_tokens_whatever_the_batch():
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(1, 1000)

    def draw(batch_extra: int) -> list[int]:
        request = _sampling_request("s", temperature=1.0, seed=1234)
        sampler.attach(request)
        others = [_sampling_request(f"o{i}", temperature=1.0) for i in range(batch_extra)]
        for o in others:
            sampler.attach(o)
        tokens = []
        for _ in range(5):
            batch = torch.cat([logits, torch.randn(batch_extra, 1000)]) if batch_extra else logits
            tokens.append(sampler(batch, [request] + others)[0])
        return tokens

    first = draw(0)
    assert draw(3) == first and draw(0) == first
    assert len(set(first)) > 1  # it does sample


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]]).repeat(200, 1)
    top_k = [_sampling_request(str(i), temperature=2.0, top_k=2) for i in range(200)]
    assert set(sampler(logits, top_k)) == {0, 1}
    top_p = [_sampling_request(str(i), temperature=1.0, top_p=0.5) for i in range(200)]
    assert set(sampler(logits, top_p)) == {0}  # the top token alone holds > 50% of the mass
