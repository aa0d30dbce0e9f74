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
    from bench.summary import Goal, goal_rows
    report = Report("capture", "m", "dev", ["cache", "kind", "size", "capture_s", "graph_mib"])
    report.add(cache="warm", kind="compile (first forward)", size="-", capture_s=20.0, graph_mib=None)
    report.add(cache="warm", kind="all graphs", size=55, capture_s=2.0, graph_mib=512.0)
    report.write(str(tmp_path))
    goals = [Goal("capture, warm", "capture", "capture_s", at_most=20.0, where={"cache": "warm", "kind": "all graphs"},
                  show=("size", "graph_mib")),
             Goal("capture, cold", "capture", "capture_s", at_most=30.0, where={"cache": "cold", "kind": "all graphs"})]
    warm, cold = goal_rows(str(tmp_path), goals)
    assert warm == ("capture, warm", "m", "capture_s <= 20", "capture_s 2.000, size 55, graph_mib 512.000", "met")
    assert cold[3:] == ("no rows", "n/a")


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
def test_serving_sends_the_workloads_over_http_and_every_request_completes(tmp_path):
    """The CPU smoke run: a server subprocess of each kind (the engine a thread of it, or a process of its
    own), the workloads over HTTP, sent == completed."""
    from bench import serving
    from tests.tiny_tokenizer import save_tiny_tokenizer
    save_tiny_tokenizer(tmp_path)  # a real tokenizer covering tiny-llama's ids: the server detokenizes
    report = serving.run("tiny-llama", requests=3, configs=["graphs off"], workloads="baseline,chunked_prefill,batch_3",
                         tokenizer=str(tmp_path), servers="thread,process")
    assert report.meta["tokenizer"] == str(tmp_path) and report.meta["stop"] and report.meta["stop_share"] > 0
    assert not any("errors" in n for n in report.notes)  # text streamed, every stop-string request accepted
    assert f"max_num_batched_tokens={serving.MAX_NUM_BATCHED_TOKENS}" in report.notes[0]
    assert f"KV blocks of {serving.BLOCK_SIZE}" in report.notes[0]
    assert [(r["config"], r["workload"]) for r in report.rows] == [
        ("graphs off/engine_thread", "baseline"), ("graphs off/engine_thread", "chunked_prefill"),
        ("graphs off/engine_thread", "batch_3"),
        ("graphs off (in-process LLM)", "baseline"), ("graphs off (in-process LLM)", "batch_3"),
        ("graphs off", "baseline"), ("graphs off", "chunked_prefill"), ("graphs off", "batch_3")]
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
    batch, concurrency = serving.make("batch_64", sizes, 1000, stop=("<a>", "<b>"))
    assert concurrency == 64 and len(batch) == 64 and {r.arrival_s for r in batch} == {0.0}
    assert {(r.prompt_len, r.output_len) for r in batch} == {(512, 128)}  # e2e's shape
    assert all(r.stop == ("<a>", "<b>") for r in batch)  # issue 38's variant: tokenizer + stop strings, all of them
    with pytest.raises(ValueError, match="batch_N"):
        serving.make("batch_x", sizes, 1000)
    assert serving.parse_servers(None) == ["process"] and serving.parse_servers("process,thread") == ["process", "thread"]
    with pytest.raises(ValueError, match=r"--servers: unknown \['threads'\]"):
        serving.parse_servers("threads")


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
    report = decode.run("tiny-llama", batches="1", contexts="16", peers="none", iters=1, decode_gemv=True,
                        quantization="fp8")
    assert report.notes[0].startswith("no decode graphs (the engine captures them on CUDA only)")
    assert [r["variant"] for r in report.rows] == ["eager", "compiled"]
    assert built[0].runtime.backend is not None  # the "compiled" row ran the infer_graphs backend
    assert "full_graph_gemv: no decode graphs on this device, nothing to time" in report.notes
    assert "full_graph_fp8: no decode graphs on this device, nothing to time" in report.notes
    assert report.meta["fp8_weight_bytes"] < report.meta["weight_bytes"]  # the model was quantized for it


@pytest.mark.gpu
def test_gpu_time_with_the_host_ahead_leaves_out_the_host_time_a_caller_waits_for():
    """A call that spends 3 ms on the host and ~0.25 ms on the GPU: median_ms (what a caller waits for)
    reads the host's time, gpu_ms_host_ahead the GPU's; the prefill suite tells host-bound rows by it."""
    import time
    import torch
    from bench.measure import gpu_ms_host_ahead, median_ms

    def call():
        time.sleep(0.003)
        torch.cuda._sleep(500_000)  # ~0.25 ms at the H100's ~2 GHz
    waited, gpu = median_ms(call, iters=10), gpu_ms_host_ahead(call, iters=10)
    assert waited > 2.5
    assert 0.05 < gpu < 1.0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_prefill_pieces_host_time_is_the_piecewise_step_less_the_full_step_over_the_layers():
    """What lies between two pieces, without the engine's own per-step work that both steps pay."""
    from bench.prefill import pieces_host_per_layer
    rows = [{"variant": "engine", "tokens": 64, "host_ms": 1.9}, {"variant": "engine_full", "tokens": 64, "host_ms": 0.5},
            {"variant": "engine", "tokens": 128, "host_ms": 2.0}, {"variant": "engine_full", "tokens": 128, "host_ms": None},
            {"variant": "engine", "tokens": 512, "host_ms": None}, {"variant": "piecewise", "tokens": 64, "host_ms": 3.0}]
    pieces_host_per_layer(rows, 28)
    assert rows[0]["pieces_host_us_per_layer"] == pytest.approx(50.0)
    assert all("pieces_host_us_per_layer" not in r for r in rows[1:])


def test_prefill_report_on_cpu_has_no_graph_rows_and_an_engine_row():
    from bench import prefill
    report = prefill.run("tiny-llama", tokens="16,24", peers="none", iters=2, quantization="fp8")
    # sorted by (tokens, variant); the engine rows next to the harness rows at every token count
    assert [(r["tokens"], r["variant"]) for r in report.rows] == [
        (t, v) for t in (16, 24) for v in ("compiled", "eager", "engine", "engine_fp8")]
    assert report.meta["fp8_weight_bytes"] < report.meta["weight_bytes"]
    assert "gpu_ms" in report.columns and all("gpu_ms" not in r for r in report.rows)  # CUDA only
    assert "graphs are captured on CUDA only" in report.notes[0]
    assert any(n.startswith("harness rows (eager, compiled, piecewise") for n in report.notes)
    engine_note = next(n for n in report.notes if n.startswith("engine rows:"))
    assert "prefix caching off" in engine_note and "no gpu_ms on the CPU" in engine_note
    for row in (r for r in report.rows if r["variant"] == "engine"):
        assert row["median_ms"] > 0 and row["ttft_ms"] > 0
        assert row["engine_steps"] == "1 none"  # one step per prompt; on the CPU the engine runs no graphs
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["median_ms"] * 1e3)
    stats = report.meta["engine_stats"]
    assert stats["prefix_cache"] is not None and "backend" not in stats
    assert stats["steps"] == 2 * (prefill.ENGINE_WARMUP + 2 * 2)  # warm-ups, generate calls, step() prefills
    assert "| engine |" in report.markdown()


def test_engine_steps_text():
    from bench.prefill import _steps_text
    assert _steps_text(1.0, {"piecewise": 1.0}) == "1 piecewise"
    assert _steps_text(2.0, {"piecewise": 2.0}) == "2 piecewise"
    assert _steps_text(2.0, {"none": 1.0, "piecewise": 1.0}) == "1 none, 1 piecewise"
    assert _steps_text(1.0, {}) == "1 step"
    assert _steps_text(2.0, {"piecewise": 1.0}) == "2 steps, 1 piecewise"


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


def test_generate_step_ms_is_the_per_token_slope_of_two_exact_generation_lengths(monkeypatch):
    import time

    import torch

    from bench import hf_peers
    clock = [0.0]
    calls = []

    class FakeGenerator(torch.nn.Module):
        """generate() costs 50 ms of set-up and prefill plus 3 ms per new token, on a fake clock."""
        config = type("Config", (), {"vocab_size": 100})()

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, max_new_tokens, min_new_tokens, **kwargs):
            calls.append((tuple(input_ids.shape), max_new_tokens, min_new_tokens, kwargs.get("cache_implementation")))
            clock[0] += 0.050 + 0.003 * max_new_tokens
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    ms = hf_peers.decode_static_generate_ms(FakeGenerator(), 2, 30, short=4, long=12, repeats=3)
    assert ms == pytest.approx(3.0)
    assert all(mx == mn for _, mx, mn, _ in calls)  # exact lengths, or the slope would mix prefill in
    assert {shape for shape, *_ in calls} == {(2, 30)} and {c for *_, c in calls} == {"static"}
    assert len(calls) == 2 + 2 * 3  # one untimed call per length, then the timed repeats
    calls.clear()
    assert hf_peers.decode_eager_generate_ms(FakeGenerator(), 1, 8, short=2, long=6) == pytest.approx(3.0)
    assert {c for *_, c in calls} == {None}  # eager: generate's default cache
    with pytest.raises(ValueError, match="short < long"):
        hf_peers.generate_step_ms(FakeGenerator(), 1, 8, short=6, long=6)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_decode_hf_eager_row_comes_from_transformers_generate(monkeypatch):
    import transformers

    from bench import decode
    lengths = []
    real_generate = transformers.GenerationMixin.generate

    def recording_generate(self, *args, **kwargs):
        lengths.append((kwargs["max_new_tokens"], kwargs["min_new_tokens"]))
        return real_generate(self, *args, **kwargs)
    monkeypatch.setattr(transformers.GenerationMixin, "generate", recording_generate)
    report = decode.run("tiny-llama", batches="1", contexts="512", peers="eager", iters=1)  # a peer point
    [row] = [r for r in report.rows if r["variant"] == "hf_eager"]
    assert (row["batch"], row["context"]) == (1, 512) and isinstance(row["median_ms"], float)
    short, long = decode.EAGER_GENERATE_LENGTHS["short"], decode.EAGER_GENERATE_LENGTHS["long"]
    assert set(lengths) == {(short, short), (long, long)}


def test_e2e_latencies_keep_only_the_intervals_where_every_request_decodes():
    from bench.e2e import latencies
    from engine.outputs import RequestOutput

    def out(ttft_s, gaps):
        output = RequestOutput("r", [1], [5] * (len(gaps) + 1), "", True, "length", ttft_s=ttft_s)
        output.__dict__["inter_token_latencies_s"] = gaps  # what the cached property would have built
        return output
    # request a starts decoding at 10 ms, b only at 40 ms (its prefill came later)
    a = out(0.010, [0.020, 0.020, 0.020, 0.004])  # tokens at 10, 30, 50, 70, 74 ms
    b = out(0.040, [0.004])                       # tokens at 40, 44 ms
    lat = latencies([a, b])
    assert lat["ttft_ms"] == pytest.approx(25.0) and lat["ttft_max_ms"] == pytest.approx(40.0)
    assert lat["steady_intervals"] == 3           # a's from 50 and 70 ms, b's from 40 ms
    assert lat["itl_ms"] == pytest.approx(4.0)    # median of 20, 4, 4: the mixed steps' intervals left out
    assert lat["itl_all_ms"] == pytest.approx(20.0)
    only_a = latencies([out(0.010, [0.020, 0.020, 0.020])])
    assert only_a["itl_ms"] == pytest.approx(20.0)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_e2e_suite_from_the_command_line_reports_each_batch_and_front_end_variant(tmp_path):
    from bench.__main__ import main
    from tests.tiny_tokenizer import save_tiny_tokenizer
    save_tiny_tokenizer(tmp_path / "tok")  # covers tiny-llama's 256 ids (the byte alphabet + specials)
    assert main(["e2e", "--model", "tiny-llama", "--batches", "1,3", "--prompt-len", "12", "--output-len", "5",
                 "--peers", "none", "--time-budget", "60", "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(tmp_path)]) == 0
    report = Report.load(str(tmp_path / "e2e-tiny-llama.json"))
    assert [(r["batch"], r["tokenizer"], r["stop_strings"]) for r in report.rows] == [
        (b, tok, stops) for b in (1, 3) for tok, stops in (("off", 0), ("on", 0), ("on", 2))]
    for row in report.rows:
        assert row["prompt_len"] == 12 and row["context"] == 12 + 5 // 2
        assert row["ttft_ms"] > 0 and row["itl_ms"] > 0 and row["ttft_max_ms"] >= row["ttft_ms"]
        assert row["output_tok_per_s"] > 0
        assert row["graph_replay_ms"] is None and row["floor_ms"] is None  # no graphs, no ceilings on the CPU
    assert any("decode graphs on CUDA only" in n for n in report.notes)
    assert any("front-end variants" in n and "<bench-never-stop-a>" in n for n in report.notes)
    from bench.e2e import WARMUP_TOKENS
    repeats = report.meta["repeats"]
    per_variant = (1 + 3) * (WARMUP_TOKENS + repeats * 5)
    stats = report.meta["engine_stats"]
    assert stats["plain"]["generated_tokens"] == per_variant
    assert stats["tokenizer"]["generated_tokens"] == 2 * per_variant  # the tokenizer and stop variants


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_e2e_with_fp8_adds_the_same_rows_from_fp8_engines(tmp_path):
    from bench.__main__ import main
    assert main(["e2e", "--model", "tiny-llama", "--batches", "2", "--prompt-len", "8", "--output-len", "3",
                 "--peers", "none", "--tokenizer", "none", "--quantization", "fp8", "--out", str(tmp_path)]) == 0
    report = Report.load(str(tmp_path / "e2e-tiny-llama.json"))
    assert [(r["batch"], r["weights"], r["tokenizer"]) for r in report.rows] == [(2, "float32", "off"),
                                                                                 (2, "fp8", "off")]
    assert all(r["itl_ms"] > 0 for r in report.rows)
    assert report.meta["fp8_weight_bytes"] < report.meta["weight_bytes"]
    assert set(report.meta["engine_stats"]) == {"plain", "plain_fp8"}


def test_paged_kv_hands_out_blocks_scrambled_or_in_order_and_never_the_scratch_block():
    import torch

    import models
    from bench.configs import TINY_LLAMA
    from bench.paged import PagedKV
    from custom_ops import SCRATCH_BLOCK
    model = models.from_config(TINY_LLAMA, dtype=torch.float32, device="cpu", seed=0)
    kv = PagedKV.allocate(model, num_blocks=9, block_size=4, fill=False, seed=3)
    try:
        assert list(kv.caches) == list(model.attention_layer_names)
        assert all(not c.any() for c in kv.caches.values())  # fill=False: zeros
        table: list[int] = []
        kv.grow(table, 30)  # 8 blocks of 4 tokens: every block but the scratch one
        assert sorted(table) == [b for b in range(9) if b != SCRATCH_BLOCK] and table != sorted(table)
        with pytest.raises(RuntimeError, match="ran out of blocks"):
            kv.grow(table, 33)
    finally:
        kv.release()
    assert kv.caches == {}
    ordered = PagedKV.allocate(model, num_blocks=5, block_size=4)
    try:
        table = [7]
        ordered.grow(table, 9)  # holds 4 already: two more blocks, in ascending order
        assert table == [7, 1, 2] and all(c.abs().sum() > 0 for c in ordered.caches.values())  # random fill
    finally:
        ordered.release()


def test_step_metadata_gives_each_sequence_its_own_contiguous_blocks():
    from bench.paged import step_metadata
    meta = step_metadata(num_seqs=3, context_len=5, query_len=2, device="cpu", block_size=4)
    # 7 tokens -> 2 blocks per sequence: 1-2, 3-4, 5-6; new tokens at positions 5 and 6 (block 1 of each)
    assert meta.block_tables.tolist() == [[1, 2], [3, 4], [5, 6]]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 4 * 4 + 1, 4 * 4 + 2, 6 * 4 + 1, 6 * 4 + 2]
    assert meta.query_start_loc.tolist() == [0, 2, 4, 6] and meta.seq_lens.tolist() == [7, 7, 7]
    assert (meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (6, 2, 7)
    assert not meta.is_uniform_decode and step_metadata(2, 5, 1, "cpu", max_seq_len=64).max_seq_len == 64


def test_capture_startup_timeline_reads_a_list_or_a_dict_of_phases():
    from bench.capture import startup_phases
    as_list = [{"name": "load", "seconds": 1.5, "allocated_bytes": 2**20}, {"phase": "compile", "seconds": 4.0}]
    assert startup_phases(as_list) == [("load", 1.5, 2**20), ("compile", 4.0, None)]
    as_dict = {"total_s": 9.0, "phases": {"compile": {"seconds": 4.0}, "decode capture": 0.5}}
    assert startup_phases(as_dict) == [("compile", 4.0, None), ("decode capture", 0.5, None)]
    assert startup_phases(None) == [] and startup_phases({}) == []


def test_capture_report_from_engine_stats_with_and_without_a_startup_timeline():
    from bench.capture import build_report
    from bench.summary import Goal, goal_rows

    def child(startup):
        return {"model": "m", "device": "dev", "build_s": 1.0, "ready_s": 12.0, "process_s": 20.0,
                "prefill_sizes": [1, 2, 4], "decode_sizes": [1, 2], "startup": startup,
                "piecewise": [{"size": 4, "capture_s": 0.3}, {"size": 2, "capture_s": 0.2},
                              {"size": 1, "capture_s": 0.1}],
                "compile_s": 5.0, "piecewise_total_s": 0.6, "piecewise_pool_bytes": 100 * 2**20,
                "decode_total_s": 0.4, "decode_graph_bytes": 10 * 2**20, "kv_pool_bytes": 2**30}
    servers = {"cold": {"ready_s": 30.5, "tokenizer": True, "compile_cache": "miss: no entry in the cache"},
               "warm": {"ready_s": 7.25, "tokenizer": False, "compile_cache": "hit"}}
    report = build_report("m", {"cold": child(None), "warm": child([{"name": "load", "seconds": 0.5}])}, servers)
    rows = {(r["cache"], r["kind"]): r for r in report.rows}
    assert rows[("cold", "serve to ready")]["capture_s"] == 30.5 and rows[("warm", "serve to ready")]["capture_s"] == 7.25
    assert rows[("warm", "serve to ready")]["note"].endswith("no tokenizer; compile cache hit")
    assert "the benchmarks' tokenizer; compile cache miss: no entry" in rows[("cold", "serve to ready")]["note"]
    assert ("cold", "startup: load") not in rows and rows[("warm", "startup: load")]["capture_s"] == 0.5
    assert [r["size"] for r in report.rows if r["kind"] == "piecewise" and r["cache"] == "warm"] == [4, 2, 1]
    total = rows[("warm", "all graphs")]
    assert total["size"] == 5 and total["capture_s"] == pytest.approx(1.0) and total["graph_mib"] == 110
    assert rows[("warm", "decode total")]["note"] == "0.200 s per graph"
    assert rows[("warm", "ready")]["capture_s"] == 12.0 and rows[("warm", "ready")]["graph_mib"] == 1024
    assert rows[("warm", "compile")]["capture_s"] == 5.0
    assert "prefill graphs on" in report.notes[0]
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        report.write(out)
        [ready] = goal_rows(out, [Goal("ready, warm", "capture", "capture_s", at_most=12.0,
                                       where={"cache": "warm", "kind": "ready"})])
    assert ready[3:] == ("capture_s 12.000", "met")


def test_capture_times_a_real_server_start_to_its_ready_line_and_reads_its_compile_cache(tmp_path):
    """The server rows of `bench capture` come from a real `serve` process over the run's caches: the
    first start misses the graph store (its own engine options), the second, over the same caches, hits."""
    import os
    from bench.capture import _server_start
    env = {**os.environ, "INFER_GRAPHS_COMPILE_CACHE": "1"}
    cold, warm = (_server_start("tiny-llama", str(tmp_path), env, 300, ("--compile",)) for _ in range(2))
    assert cold["compile_cache"].startswith("miss") and warm["compile_cache"] == "hit", (cold, warm)
    assert 0 < cold["ready_s"] < 300 and 0 < warm["ready_s"] < 300


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run of the suite")
def test_prefix_report_compares_caching_on_and_off_on_shared_and_unique_prompts():
    from bench import prefix
    report = prefix.run("tiny-llama", requests=3, host_rows=False)
    assert "a 64-token prompt" in report.notes[0] and f"KV blocks of {prefix.BLOCK_SIZE}" in report.notes[0]
    rows = {(r["workload"], r["caching"], r["arrivals"]): r for r in report.rows}
    assert len(rows) == 8 and all(r["requests"] == 3 for r in rows.values())
    # (how many shared-prompt requests hit depends on when they arrive; unique prompts never hit)
    assert all(r["hit_rate"] is None for key, r in rows.items() if key[1] == "off")
    assert rows["unique", "on", "poisson"]["hit_rate"] == 0.0 and rows["shared", "on", "poisson"]["hit_rate"] >= 0
    specs = prefix.make_specs(3, 64, 8, 4, 256, shared=True, rate_per_s=None, seed=0)
    assert specs[0].prompt_ids[:64] == specs[2].prompt_ids[:64] and specs[0].prompt_ids != specs[2].prompt_ids
    assert prefix.host_us_per_step(specs, True, 4, 96) > 0 and prefix.prepare_us(4, 64, steps=3) > 0
    assert prefix.bookkeeping_us_per_block(True, num_requests=6, blocks_per_request=2) > 0


def test_serving_configs_take_short_names_and_reject_unknown_ones():
    from bench import serving
    assert serving.config_names("prefill,off") == ["decode + prefill graphs", "graphs off"]
    assert serving.config_names(None) == list(serving.CONFIGS)
    with pytest.raises(ValueError, match="unknown.*'fast'"):
        serving.config_names("decode,fast")


def test_capture_children_get_bytecode_caching_as_an_installed_torch_has(tmp_path, monkeypatch):
    """The start-up bench measures what a user's installed torch does: bytecode writes are never
    forbidden for the children, and where torch has no .pyc a cache of their own is made (and primed)."""
    from bench import capture
    env, prime, note = capture.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1", "X": "y"}, str(tmp_path))
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["X"] == "y"
    assert ("PYTHONPYCACHEPREFIX" in env) == prime
    assert ("no .pyc" in note) == prime
    monkeypatch.setattr(capture, "has_cached_bytecode", lambda path: False)
    env, prime, note = capture.bytecode_env({}, str(tmp_path))
    assert prime and env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache") and "no .pyc" in note
    env, prime, _ = capture.bytecode_env({"PYTHONPYCACHEPREFIX": "/elsewhere"}, str(tmp_path))
    assert prime and env["PYTHONPYCACHEPREFIX"] == "/elsewhere"
    monkeypatch.setattr(capture, "has_cached_bytecode", lambda path: True)
    env, prime, note = capture.bytecode_env({}, str(tmp_path))
    assert not prime and "PYTHONPYCACHEPREFIX" not in env


def test_cached_bytecode_is_found_where_python_would_load_it(tmp_path):
    import py_compile

    from bench.capture import has_cached_bytecode
    source = tmp_path / "module_x.py"
    source.write_text("X = 1\n")
    assert not has_cached_bytecode(str(source))
    py_compile.compile(str(source))  # where the running interpreter puts it (beside it, or under its prefix)
    assert has_cached_bytecode(str(source))


def test_a_profiled_call_keeps_its_result_and_writes_each_order(tmp_path):
    from bench.profiling import cprofiled
    prefix = str(tmp_path / "startup-warm")
    assert cprofiled(lambda: sorted(range(5, 0, -1)), prefix, sort=("cumulative", "tottime")) == [1, 2, 3, 4, 5]
    assert (tmp_path / "startup-warm.prof").stat().st_size > 0
    text = (tmp_path / "startup-warm.txt").read_text()
    assert "Ordered by: cumulative time" in text and "Ordered by: internal time" in text


def test_step_timeline_marks_stages_and_leaves_the_objects_as_they_were():
    """bench/step_timeline.marked wraps an instance's method, an instance attribute and a module function
    for the block, and afterwards the instance has no attribute of its own where it had none."""
    import types

    from bench.step_timeline import marked

    class Loop:
        def step(self):
            return "step"
    loop, module = Loop(), types.ModuleType("m")
    loop.wait_for = lambda: "wait"
    module.sample = lambda: "sample"
    originals = (loop.wait_for, module.sample)
    with marked([(loop, "step", "step"), (loop, "wait_for", "wait"), (module, "sample", "sample")]):
        assert "step" in vars(loop) and (loop.step(), loop.wait_for(), module.sample()) == ("step", "wait", "sample")
    assert "step" not in vars(loop) and (loop.wait_for, module.sample) == originals
