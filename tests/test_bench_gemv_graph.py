"""The gemv_graph suite (bench/gemv_graph.py): which configs it tries, which shapes of a model it sweeps,
and which candidate it picks against the run's noise. Its timing runs on a GPU only."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bench import gemv_graph
from custom_ops import GEMV_CONFIGS, GemvConfig


def test_candidates_leave_out_the_entry_and_splits_thinner_than_a_quarter_tile():
    entry = GEMV_CONFIGS[(3072, 8192)]
    tried = gemv_graph.candidates((3072, 8192), entry)
    assert entry not in tried and len(tried) == len(gemv_graph.CANDIDATES) - (entry in gemv_graph.CANDIDATES)
    narrow = gemv_graph.candidates((1152, 256), GemvConfig())
    assert narrow and all(c.block_k * c.split_k <= 1024 for c in narrow)
    assert GemvConfig(block_n=16, block_k=256, split_k=8) not in narrow  # 2048 columns of splits for K = 256


def test_neighbours_are_the_entrys_tile_with_other_stages_and_warps_and_labelled_apart():
    entry = GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3)
    tried = gemv_graph.neighbours(entry)
    assert entry not in tried and len(tried) == 5
    assert all((c.block_n, c.block_k, c.split_k) == (8, 1024, 1) for c in tried)
    assert sorted(c.num_stages for c in tried if c.num_warps == 4) == [1, 2, 4]
    assert sorted(c.num_warps for c in tried if c.num_stages == 3) == [2, 8]
    labels = [c.label() for c in (entry, *tried)]
    assert len(set(labels)) == len(labels) and entry.label() == "n8k1024s1w4"


def test_whole_k_tiles_span_the_weights_rows_within_the_register_budget():
    tried = gemv_graph.whole_k((3072, 3072), GEMV_CONFIGS[(3072, 3072)])
    assert tried and all(c.block_k == 4096 and c.split_k == 1 and c.block_n in (2, 4) for c in tried)
    down = gemv_graph.whole_k((3072, 8192), GEMV_CONFIGS[(3072, 8192)])
    assert {(c.block_n, c.num_warps) for c in down} == {(2, 4), (2, 8), (4, 8)}  # 4 rows x 8192 at 4 warps: 256 a thread
    assert all(c.block_n * c.block_k // (32 * c.num_warps) <= 128 for c in down)


def test_model_shapes_are_the_tables_shapes_among_its_weights_in_order():
    model = nn.Sequential(nn.Linear(3072, 5120, bias=False, device="meta"),   # llama-3.2-3b qkv
                          nn.Linear(3072, 3072, bias=False, device="meta"),   # o
                          nn.Linear(100, 7, device="meta"),                   # not in the table
                          nn.Linear(3072, 3072, bias=False, device="meta"))   # o again: listed once
    assert gemv_graph.model_shapes(model) == [(5120, 3072), (3072, 3072)]


def _row(shape, config, delta_us):
    return dict(shape=shape, config=config, delta_us=delta_us)


def test_a_pick_must_beat_the_entry_by_more_than_twice_the_base_spread():
    rows = [_row((16384, 3072), "n16k512s1w4", -85.2), _row((16384, 3072), "n8k256s1w4", -76.9),
            _row((5120, 3072), "n4k512s1w4", -2.7), _row((3072, 3072), "n8k512s1w8", 1.4),
            _row((3072, 8192), "n8k1024s1w4", -7.1)]
    base_ms = [2.7387, 2.7375, 2.7371, 2.7400]  # spread 2.9 us: noise 5.8 us
    chosen = gemv_graph.picks(rows, base_ms)
    assert {shape: row["config"] for shape, row in chosen.items()} == {
        (16384, 3072): "n16k512s1w4", (3072, 8192): "n8k1024s1w4"}
    quiet = gemv_graph.picks(rows, [1.2080, 1.2080])  # no spread: still at least 1 us
    assert set(quiet) == {(16384, 3072), (3072, 8192), (5120, 3072)}


def test_the_suite_refuses_to_run_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the suite would run")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gemv_graph.run("llama-3.2-3b")


def test_the_fp8_sweep_starts_from_what_the_engine_runs_and_restores_it(monkeypatch):
    """--quantization fp8: a shape's entry is fp8_config's choice (here the bf16 table's tile, no FP8
    entry yet); a candidate is written as an FP8 entry and restoring leaves FP8_GEMV_CONFIGS as it was."""
    from custom_ops import gemv_table
    monkeypatch.setattr(gemv_table, "FP8_GEMV_CONFIGS", {})
    shape = (3072, 8192)
    table = gemv_graph.Fp8Table([shape], capability=(9, 0))
    assert shape in table and table.entry(shape) == gemv_table.TABLES[(9, 0)].gemv[shape]
    wide = GemvConfig(block_n=8, block_k=2048)
    assert wide in gemv_graph.candidates(shape, table.entry(shape), gemv_graph.FP8_CANDIDATES)
    table.set(shape, wide)
    assert table.entry(shape) == wide and gemv_table.FP8_GEMV_CONFIGS == {shape: wide}
    table.restore(shape)
    assert gemv_table.FP8_GEMV_CONFIGS == {} and table.entry(shape) == gemv_table.TABLES[(9, 0)].gemv[shape]


def test_above_one_row_the_sweep_edits_the_bucket_the_graphs_rows_read_and_restores_it():
    """--batches 5 (a verify step of 1 + 4 tokens): the 2-8-row bucket; a shape without an entry (cuBLAS's
    default) gets the skinny candidates and cuBLASLt, and restoring leaves the table exactly as it was."""
    from custom_ops import gemv_table
    from custom_ops.gemv_table import CUBLASLT, GemvConfig as Config, gemv_config
    o, qkv = (3072, 3072), (5120, 3072)  # llama-3.2-3b: o has a bucket-8 tile, qkv runs cuBLAS
    skinny = {o: {8: Config(block_n=64, block_k=128, split_k=4), 16: Config(block_n=64, block_k=128, split_k=3)}}
    before = {shape: dict(choices) for shape, choices in skinny.items()}
    table = gemv_graph.SkinnyTable(skinny, 5)
    assert table.bucket == 8 and table.entry(o) == before[o][8] and table.entry(qkv) is None
    tried = gemv_graph.skinny_candidates(qkv, None)
    assert None not in tried and CUBLASLT in tried and all(isinstance(c, Config) for c in tried if c != CUBLASLT)
    assert None in gemv_graph.skinny_candidates(o, table.entry(o))  # a tiled shape tries cuBLAS's default too
    table.set(qkv, tried[0])
    table.set(o, None)
    tables = gemv_table.TunedTables("test", {}, skinny)
    assert skinny[qkv] == {8: tried[0]} and 8 not in skinny[o] and skinny[o][16] == before[o][16]
    capability = (0, 0)  # no real GPU's: the tables gemv_config reads for it are these
    gemv_table._by_capability[capability] = tables
    try:
        assert gemv_config(5, *qkv, torch.bfloat16, "cuda", capability=capability) == tried[0]
        assert gemv_config(5, *o, torch.bfloat16, "cuda", capability=capability) is None
    finally:
        del gemv_table._by_capability[capability]
    table.restore(qkv)
    table.restore(o)
    assert skinny == before
    assert [gemv_graph.label(c) for c in (None, CUBLASLT, before[o][8])] == ["cublas", "cublaslt", "n64k128s4w4"]


_TINY = {  # small configs of the three architectures, heads and intermediate size divisible by 4
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=101, hidden_size=64,
                  intermediate_size=80, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=101, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=16, max_position_embeddings=128),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=101, hidden_size=64,
                   intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=32, max_position_embeddings=128, query_pre_attn_scalar=32, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("arch", sorted(_TINY))
@pytest.mark.parametrize("tp_size", [2, 4])
def test_one_ranks_model_on_one_device_has_exactly_rank_0s_shapes(arch, tp_size):
    """--tp-size: the model the sweep builds on one GPU holds every parameter in the shape rank 0 of a
    real tensor-parallel model holds it (KV heads split, or replicated past their count; the vocabulary
    ceil(V / N) rows), so the table entries it picks are those the TP engine looks up."""
    import models
    from bench.gemm import rank_config
    from models.parallel import TensorParallel
    config = _TINY[arch]
    proxy = models.from_config(rank_config(config, tp_size), dtype=torch.float32, device="meta")
    rank0 = models.from_config(config, dtype=torch.float32, device="meta",
                               tp=TensorParallel(0, tp_size, group=object()))  # building reads no group
    assert {n: tuple(p.shape) for n, p in proxy.named_parameters()} == \
        {n: tuple(p.shape) for n, p in rank0.named_parameters()}
    assert gemv_graph.model_shapes(proxy, False) == gemv_graph.model_shapes(rank0, False)
    assert rank_config(config, 1) == config


def test_every_linear_and_the_lm_head_are_swept_without_a_table_and_restoring_puts_back_no_entry():
    import models
    model = models.from_config(_TINY["llama"], dtype=torch.float32, device="meta")
    # qkv (8 + 2 * 2 heads of 16), o, gate_up, down, then the LM head; the embedding is no matmul of its own
    assert gemv_graph.model_shapes(model, False) == [(192, 64), (64, 128), (160, 64), (64, 80), (101, 64)]
    assert gemv_graph.model_shapes(model, {(64, 80): GemvConfig()}) == [(64, 80)]  # with a table: its shapes only
    entries = {(64, 80): GemvConfig()}
    table = gemv_graph.GemvTable(entries)
    table.set((64, 80), None)  # no entry: cuBLAS
    table.set((192, 64), GemvConfig(block_n=8))
    assert entries == {(192, 64): GemvConfig(block_n=8)} and table.entry((64, 80)) is None
    table.restore((64, 80))
    table.restore((192, 64))
    assert entries == {(64, 80): GemvConfig()}


def test_the_fp8_skinny_sweep_starts_from_what_the_engine_runs_and_restores_it(monkeypatch):
    """--batches 5 --quantization fp8: a shape's entry is fp8_config's choice at 5 rows (the bf16 table's
    bucket-8 tile here, no FP8 entry yet); a candidate lands in FP8_SKINNY_CONFIGS' bucket 8 only, the
    candidates add 256-wide K tiles and no cuBLAS, and restoring leaves the FP8 table as it was."""
    from custom_ops import gemv_table
    monkeypatch.setattr(gemv_table, "FP8_SKINNY_CONFIGS", {})
    shape = (3072, 8192)  # llama-3.2-3b's down projection: a bf16 tile at bucket 8
    table = gemv_graph.Fp8SkinnyTable(5, capability=(9, 0))
    assert table.bucket == 8 and table.entry(shape) == gemv_table.TABLES[(9, 0)].skinny[shape][8]
    tried = gemv_graph.fp8_skinny_candidates(shape, table.entry(shape))
    assert all(isinstance(c, GemvConfig) for c in tried) and any(c.block_k == 256 for c in tried)
    table.set(shape, tried[0])
    assert table.entry(shape) == tried[0] and gemv_table.FP8_SKINNY_CONFIGS == {shape: {8: tried[0]}}
    table.restore(shape)
    assert gemv_table.FP8_SKINNY_CONFIGS == {} and table.entry(shape) == gemv_table.TABLES[(9, 0)].skinny[shape][8]
