"""The benchmark suites' pure logic: floors, reports, workload, coverage, size suggestion, idle time."""
from __future__ import annotations

import itertools
import json
import math

import pytest

from bench.coverage import Step, bucket, coverage, padded_tokens, simulate_steps, suggest_sizes
from bench.floors import KVLayer, ModelCost, decode_bytes, decode_floor_ms, prefill_floor_ms, prefill_flops
from bench.measure import Report, ratio
from bench.profiling import idle_fraction, merge_intervals, per_step_idle
from bench.workload import make_workload, percentile, summarize

COST = ModelCost(weight_bytes=6_000_000_000, matmul_params=2_800_000_000, logits_params=3072 * 128256,
                 kv_layers=tuple(KVLayer(8, 128) for _ in range(28)))


def test_decode_floor_is_weights_plus_attended_kv_over_bandwidth():
    per_token = 28 * 2 * 8 * 128 * 2
    assert COST.kv_bytes_per_token() == per_token
    assert decode_bytes(COST, 4, 100) == 6_000_000_000 + 4 * 100 * per_token
    assert decode_floor_ms(COST, 1, 0, 3e12) == pytest.approx(2.0)


def test_sliding_layers_read_only_their_window():
    cost = ModelCost(0, 0, 0, (KVLayer(1, 256, 512), KVLayer(1, 256, None)))
    assert cost.kv_bytes_read(4096) == 2 * 256 * 2 * (512 + 4096)
    assert cost.kv_bytes_read(100) == 2 * 256 * 2 * 200


def test_prefill_floor_is_max_of_weight_pass_and_matmul_time():
    bw, rate = 3e12, 8e14
    assert prefill_floor_ms(COST, 1, bw, rate) == pytest.approx(2.0)  # memory bound
    flops = prefill_flops(COST, 4096)
    assert flops == 2 * 2_800_000_000 * 4096 + 2 * 3072 * 128256
    assert prefill_floor_ms(COST, 4096, bw, rate) == pytest.approx(flops / rate * 1e3)


def test_model_cost_counts_tied_embedding_once():
    import torch

    import models
    from bench.configs import TINY_LLAMA
    from bench.floors import model_cost
    model = models.from_config(TINY_LLAMA, dtype=torch.float32, device="cpu", seed=0)
    cost = model_cost(model)
    n_params = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    assert cost.weight_bytes == 4 * n_params
    assert cost.matmul_params == n_params - 256 * 64
    # The same count from the config alone (hidden 64, 4 q / 2 kv heads of 16, MLP 128, 2 layers, tied):
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # qkv, o, gate/up/down, 2 norms
    assert n_params == 2 * per_layer + 256 * 64 + 64                  # + embedding, final norm
    assert cost.kv_bytes_per_token() == 2 * (2 * 2 * 16 * 4)


def test_report_writes_json_markdown_and_ratio(tmp_path):
    report = Report("decode", "m", "dev", ["variant", "median_ms", "floor_ms", "x_floor"])
    report.add(variant="full_graph", median_ms=2.5, floor_ms=2.0, x_floor=ratio(2.5, 2.0))
    report.add(variant="peer", median_ms=None, floor_ms=2.0, x_floor=ratio(None, 2.0))
    report.notes.append("a note")
    paths = report.write(str(tmp_path))
    data = json.loads((tmp_path / "decode-m.json").read_text())
    assert data["rows"][0]["x_floor"] == 1.25 and data["columns"][0] == "variant"
    md = (tmp_path / "decode-m.md").read_text()
    assert "| full_graph | 2.500 | 2.000 | 1.250 |" in md and "| peer | - | 2.000 | - |" in md
    assert "- a note" in md
    back = Report.load(paths[0])
    assert back.rows == report.rows and back.suite == "decode"


def test_report_notes_a_skipped_plot_in_json_and_markdown(tmp_path):
    def no_matplotlib(report):
        raise ImportError("No module named 'matplotlib'")
    report = Report("decode", "m", "dev", ["variant"])
    report.add(variant="eager")
    report.plots.append(("latency", no_matplotlib))
    paths = report.write(str(tmp_path))
    assert len(paths) == 2  # JSON and Markdown, no image
    note = "plot latency skipped: No module named 'matplotlib'"
    assert Report.load(paths[0]).notes == [note]
    assert f"- {note}" in (tmp_path / "decode-m.md").read_text()


def test_decode_peer_note_names_only_the_peers_run():
    from bench.decode import peer_note
    eager_only = peer_note([(1, 512), (32, 512)], [])  # --peers eager, or no CUDA: nothing compiled ran
    assert "hf_eager at bs1 ctx512, bs32 ctx512" in eager_only
    assert "compiled" not in eager_only
    both = peer_note([(1, 512)], [(1, 512)])
    assert "hf_static_compiled and ours_reduce_overhead at bs1 ctx512" in both
    assert "no point of this grid" in peer_note([], [])


def test_summary_capture_goal_reads_the_report_and_tolerates_a_missing_cold_run(tmp_path):
    from bench.summary import CAPTURE_SECONDS_GOAL, goal_rows
    report = Report("capture", "m", "dev", ["cache", "kind", "size", "capture_s", "graph_mib"])
    report.add(cache="warm", kind="compile (first forward)", size="-", capture_s=CAPTURE_SECONDS_GOAL, graph_mib=None)
    report.add(cache="warm", kind="all graphs", size=55, capture_s=2.0, graph_mib=512.0)
    report.write(str(tmp_path))
    [(goal, target, measured, status)] = goal_rows(str(tmp_path))[-1:]
    assert goal == "capture all default sizes, m"
    assert "55 graphs captured in 2.0 s" in measured and "no cold run" in measured and "0.50 GiB" in measured
    assert status == f"met (capture; with the warm compile the start-up is over {CAPTURE_SECONDS_GOAL:g} s)"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
def test_capture_suite_refuses_to_report_zeros_without_cuda():
    from bench import capture
    for call in (lambda: capture.measure("tiny-llama"), lambda: capture.run("tiny-llama")):
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            call()


def test_default_results_dir_is_named_for_the_gpu_model():
    from bench.__main__ import gpu_tag
    assert gpu_tag("NVIDIA H100 80GB HBM3") == "h100"  # the last word, "HBM3", was used before
    assert gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert gpu_tag("NVIDIA GeForce RTX 4090") == "4090"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_serving_sends_the_workloads_over_http_and_every_request_completes():
    """The CPU smoke run: one server subprocess, two workloads over HTTP, sent == completed."""
    from bench import serving
    report = serving.run("tiny-llama", requests=3, configs=["graphs off"], workloads="baseline,chunked_prefill")
    assert f"max_num_batched_tokens={serving.MAX_NUM_BATCHED_TOKENS}" in report.notes[0]
    assert f"KV blocks of {serving.BLOCK_SIZE}" in report.notes[0]
    assert [(r["config"], r["workload"]) for r in report.rows] == [
        ("graphs off", "baseline"), ("graphs off", "chunked_prefill"), ("graphs off (in-process LLM)", "baseline")]
    for row in report.rows:
        assert row["sent"] == row["completed"] > 0 and row["output_tok_per_s"] > 0
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] > 0 and not row["graph_mib"]
    assert "| graphs off (in-process LLM) | baseline |" in report.markdown()


def test_serving_workloads_have_their_shape():
    from bench import serving
    sizes = serving.sizes_for(True, None, None)
    baseline, concurrency = serving.make("baseline", sizes, 1000)
    assert concurrency == 1 and {r.prompt_len for r in baseline} == {512}
    mixed, _ = serving.make("chunked_prefill", sizes, 1000)
    assert any(r.prompt_len >= sizes.long_prompt[0] for r in mixed) and [r.arrival_s for r in mixed] == sorted(
        r.arrival_s for r in mixed)
    shared, _ = serving.make("prefix_caching", sizes, 1000)
    assert len({r.prompt_ids[:sizes.system_prompt] for r in shared}) == 1
    assert all(r.prompt_len + r.output_len <= sizes.max_model_len for r in baseline + mixed + shared)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_decode_report_on_cpu_claims_no_graphs_and_times_a_compiled_model(monkeypatch):
    import engine
    from bench import decode
    built = []
    real_llm = engine.LLM

    def recording_llm(*args, **kwargs):
        built.append(real_llm(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(engine, "LLM", recording_llm)
    report = decode.run("tiny-llama", batches="1", contexts="16", peers="none", iters=1)
    assert report.notes[0].startswith("no decode graphs (the engine captures them on CUDA only)")
    assert [r["variant"] for r in report.rows] == ["eager", "compiled"]
    assert built[0].runtime.backend is not None  # the "compiled" row ran the infer_graphs backend


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_prefill_report_on_cpu_has_no_graph_rows():
    from bench import prefill
    report = prefill.run("tiny-llama", tokens="16", peers="none", iters=1)
    assert [r["variant"] for r in report.rows] == ["compiled", "eager"]  # sorted by (tokens, variant)
    assert "graphs are captured on CUDA only" in report.notes[-1]


def test_workload_is_seeded_and_within_bounds():
    a = make_workload(50, 10.0, (8, 32), (4, 16), vocab_size=100, seed=3)
    b = make_workload(50, 10.0, (8, 32), (4, 16), vocab_size=100, seed=3)
    assert a == b
    assert all(8 <= s.prompt_len <= 32 and 4 <= s.output_len <= 16 and len(s.prompt_ids) == s.prompt_len for s in a)
    arrivals = [s.arrival_s for s in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 2.0 < arrivals[-1] < 10.0  # 49 gaps of mean 0.1 s
    assert all(s.arrival_s == 0 for s in make_workload(5, math.inf, (1, 2), (1, 2), 10))


def test_percentiles_and_summary():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    s = summarize([0.1, 0.3], [0.01, 0.02, 0.03], output_tokens=40, makespan_s=2.0, prompt_tokens=60)
    assert s["output_tok_per_s"] == 20 and s["total_tok_per_s"] == 50
    assert s["ttft_p50_ms"] == pytest.approx(200) and s["itl_p50_ms"] == pytest.approx(20)


def test_coverage_follows_the_dispatcher_rule():
    steps = [Step(1, True), Step(3, True), Step(40, True), Step(100, False), Step(600, False), Step(5, False)]
    cov = coverage(steps, decode_sizes=[1, 2, 4, 8, 16, 32], piecewise_sizes=[8, 64, 128, 512])
    # 1 -> full 1; 3 -> full 4; 40 uniform > 32 -> piecewise 64; 100 -> 128; 600 -> none; 5 -> piecewise 8
    assert (cov.full_steps, cov.piecewise_steps, cov.none_steps) == (2, 3, 1)
    assert cov.hit_rate == pytest.approx(5 / 6)
    assert cov.graph_real_tokens == 1 + 3 + 40 + 100 + 5
    assert cov.graph_padded_tokens == 1 + 4 + 64 + 128 + 8
    assert cov.padding_waste == pytest.approx(1 - 149 / 205)
    assert cov.token_hit_rate == pytest.approx(149 / 749)
    assert bucket(9, [8, 16]) == 16 and bucket(17, [8, 16]) is None


def _brute_force(histogram, k):
    values = sorted(histogram)
    best = None
    for r in range(1, k + 1):
        for combo in itertools.combinations(values[:-1], r - 1):
            sizes = list(combo) + [values[-1]]
            cost = padded_tokens(histogram, sizes)
            if best is None or cost < best[0]:
                best = (cost, sizes)
    return best[0]


@pytest.mark.parametrize("seed", range(4))
def test_suggest_sizes_is_optimal_against_brute_force(seed):
    import random
    rng = random.Random(seed)
    histogram = {rng.randint(1, 300): rng.randint(1, 20) for _ in range(9)}
    for k in (1, 2, 3, 4):
        sizes = suggest_sizes(histogram, k)
        assert len(sizes) <= k and max(sizes) == max(histogram)
        assert padded_tokens(histogram, sizes) == _brute_force(histogram, k)


def test_suggest_sizes_caps_and_small_inputs():
    assert suggest_sizes({5: 1, 9: 2}, 4) == [5, 9]
    assert suggest_sizes({5: 1, 900: 2}, 2, max_size=512) == [5]
    assert suggest_sizes({}, 3) == []
    with pytest.raises(ValueError):
        suggest_sizes({1: 1}, 0)


def test_simulated_schedule_decodes_every_output_token():
    specs = make_workload(6, 200.0, (10, 40), (3, 6), vocab_size=50, seed=1)
    steps = simulate_steps(specs, max_num_seqs=4, max_num_batched_tokens=32)
    assert sum(s.num_tokens for s in steps) == sum(s.prompt_len + s.output_len - 1 for s in specs)
    assert all(s.num_tokens <= 32 for s in steps)
    assert any(s.uniform_decode for s in steps) and any(not s.uniform_decode for s in steps)


def test_idle_fraction_between_kernels():
    assert idle_fraction([]) == 0.0
    assert idle_fraction([(0, 10), (10, 20)]) == 0.0
    assert idle_fraction([(0, 10), (30, 40)]) == pytest.approx(0.5)
    assert merge_intervals([(5, 8), (0, 6), (10, 12)]) == [(0, 8), (10, 12)]
    # two steps of [busy 2, gap 2, busy 2] separated by a long pause
    trace = [(0, 2), (4, 6), (100, 102), (104, 106)]
    assert per_step_idle(trace, 2) == pytest.approx([1 / 3, 1 / 3])
