"""cudagraph_mode: the seeds' five graph modes as one EngineConfig field, the dispatcher's table for
each, and the layout the mixed-step graphs of FULL replay.

The layout is checked on the CPU: a stand-in runs, eagerly, exactly what a captured mixed graph runs
(the FULL forward over the bucket's static buffers laid out with empty sequences after the step's
own, padding rows owned by none, the real token count read from query_start_loc), and the tokens must
equal transformers' greedy ones with chunked prefill, prefix hits and sliding windows. The graphs
themselves are checked on the GPU (tests/test_engine_gpu.py).
"""
from __future__ import annotations

import pytest

from custom_ops import RuntimeMode
from engine import LLM, ConfigError, EngineConfig, SamplingParams
from engine.config import CUDAGRAPH_MODES
from engine.worker.dispatch import BatchDescriptor, Dispatcher
from tests.test_engine_generate import MAX_TOKENS, PROMPTS, SMALL, _EagerDecodeGraphs, saved_models  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


class _EagerMixedGraphs:
    """Stands in for engine.worker.mixed_graphs.MixedGraphs on the CPU: the forward a mixed graph of
    num_tokens records, over whatever step the runner loaded into its buffers."""

    def __init__(self, runner, sizes):
        self.runner, self.sizes = runner, tuple(sizes)
        self.replays, self.replays_by_size, self.capture_seconds, self.graph_bytes = 0, {}, 0.0, 0
        self.tokens_seen: list[int] = []

    def replay(self, num_tokens):
        runner = self.runner
        meta = runner.mixed_metadata(num_tokens)
        assert meta.num_seqs == runner.max_seqs and meta.real_tokens_on_device
        real = int(runner.buffers.query_start_loc[runner.max_seqs])
        self.tokens_seen.append(real)
        hidden = runner.run_forward(meta, RuntimeMode.FULL, num_tokens)
        self.replays += 1
        self.replays_by_size[num_tokens] = self.replays_by_size.get(num_tokens, 0) + 1
        return hidden

    def release(self):
        pass


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_mixed_graph_layout_gives_transformers_tokens(saved_models, arch):  # noqa: F811
    path, expected = saved_models[arch]
    llm = LLM(str(path), **SMALL)
    runner = llm.runtime.runner
    runner.decode_graphs = _EagerDecodeGraphs(runner, (2, 4))
    runner.mixed_graphs = mixed = _EagerMixedGraphs(runner, (4, 8))
    runner.dispatcher = Dispatcher((2, 4), (), decode_graphs_wanted=True, mixed_sizes=(4, 8), mixed_graphs_wanted=True)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    # again: the prompts' full blocks now come from the prefix cache, and the steps differ
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    stats = llm.stats()
    assert stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["modes"]["full"] > 0 and "none" not in stats["modes"] and stats["fallbacks"] == 0
    assert mixed.replays > 0 and set(mixed.replays_by_size) <= {4, 8}
    assert any(n not in (4, 8) for n in mixed.tokens_seen)  # padded steps were replayed
    runner.decode_graphs = runner.mixed_graphs = None
    llm.close()


def test_mode_table_names_what_each_mode_captures():
    assert CUDAGRAPH_MODES == {
        "NONE": (False, False, False), "PIECEWISE": (False, True, False), "FULL": (True, False, True),
        "FULL_DECODE_ONLY": (True, False, False), "FULL_AND_PIECEWISE": (True, True, False)}
    for mode, (decode, piecewise, mixed) in CUDAGRAPH_MODES.items():
        config = EngineConfig(cudagraph_mode=mode.lower())
        assert config.cudagraph_mode == mode  # any case, stored as the seeds spell it
        # the simple switches in agreement are accepted
        EngineConfig(cudagraph_mode=mode, cuda_graphs=decode, prefill_graphs=piecewise)


@pytest.mark.parametrize("fields,names", [
    (dict(cudagraph_mode="FULL", prefill_graphs=True), ("cudagraph_mode='FULL'", "prefill_graphs=True")),
    (dict(cudagraph_mode="PIECEWISE", cuda_graphs=True), ("cudagraph_mode='PIECEWISE'", "cuda_graphs=True")),
    (dict(cudagraph_mode="NONE", cuda_graphs=True), ("cudagraph_mode='NONE'", "cuda_graphs=True")),
])
def test_a_mode_and_a_switch_that_disagree_is_an_error_naming_both(fields, names):
    with pytest.raises(ConfigError) as error:
        EngineConfig(**fields)
    assert all(name in str(error.value) for name in names)


def test_unknown_mode_and_piecewise_without_compile_are_refused():
    with pytest.raises(ConfigError, match="cudagraph_mode='FULL_GRAPH' is invalid: expected None or one of NONE"):
        EngineConfig(cudagraph_mode="FULL_GRAPH")
    with pytest.raises(ConfigError, match="cudagraph_mode='PIECEWISE' needs compile=True"):
        EngineConfig(cudagraph_mode="PIECEWISE", compile=False)


def test_simple_switches_resolve_to_their_mode_and_the_cpu_to_none(caplog):
    cpu = EngineConfig(device="cpu", cudagraph_mode="FULL").resolve(128)
    assert cpu.cudagraph_mode == "NONE" and not cpu.cuda_graphs and not cpu.prefill_graphs and not cpu.mixed_graphs
    assert "cudagraph_mode='FULL' ignored" in caplog.text
    assert EngineConfig(device="cpu").resolve(128).cudagraph_mode == "NONE"
    assert EngineConfig(device="cpu", cuda_graphs=False, prefill_graphs=False).resolve(128).cudagraph_mode == "NONE"


def test_dispatcher_sends_each_step_to_its_modes_graph():
    full = Dispatcher((1, 2, 4), (), decode_graphs_wanted=True, mixed_sizes=(4, 16), mixed_graphs_wanted=True)
    assert full.dispatch(BatchDescriptor(3, True)).descriptor == BatchDescriptor(4, True)  # a decode graph
    mixed = full.dispatch(BatchDescriptor(3, False))
    assert mixed.mode is RuntimeMode.FULL and mixed.descriptor == BatchDescriptor(4, False) and mixed.fallback is None
    assert full.dispatch(BatchDescriptor(16, False)).descriptor == BatchDescriptor(16, False)
    # a decode batch past the decode graphs takes a mixed graph, counted as a fallback
    big = full.dispatch(BatchDescriptor(9, True))
    assert big.mode is RuntimeMode.FULL and big.descriptor == BatchDescriptor(16, False) and big.fallback
    past = full.dispatch(BatchDescriptor(17, False))
    assert past.mode is RuntimeMode.NONE and "17 tokens > largest mixed graph 16" in past.fallback
    assert full.fallback_counts == {big.fallback: 1, past.fallback: 1}
    with pytest.raises(ValueError, match="piecewise and mixed graphs serve the same steps"):
        Dispatcher((), (4,), piecewise_graphs_wanted=True, mixed_sizes=(4,), mixed_graphs_wanted=True)
    # PIECEWISE alone: decodes too run the pieces' graphs, and nothing counts as a fallback
    piecewise = Dispatcher((), (1, 2, 4), piecewise_graphs_wanted=True)
    for uniform in (True, False):
        d = piecewise.dispatch(BatchDescriptor(3, uniform))
        assert d.mode is RuntimeMode.PIECEWISE and d.descriptor.num_tokens == 4 and d.fallback is None


def test_llm_stats_report_the_mode(saved_models):  # noqa: F811
    path, _ = saved_models["llama"]
    with LLM(str(path), **SMALL) as llm:
        stats = llm.stats()
    assert stats["cudagraph_mode"] == "NONE" and stats["mixed_graphs"] == 0


def test_the_cli_takes_the_mode_in_any_case_and_names_the_choices(capsys):
    from engine.entrypoints.cli_args import OneLineErrorParser, add_engine_args, engine_config_fields
    parser = OneLineErrorParser(prog="infer-graphs generate")
    add_engine_args(parser)
    assert engine_config_fields(parser.parse_args(["--cudagraph-mode", "full"])) == {"cudagraph_mode": "FULL"}
    assert "cudagraph_mode" not in engine_config_fields(parser.parse_args([]))  # the engine's default
    with pytest.raises(SystemExit):
        parser.parse_args(["--cudagraph-mode", "full_graph"])
    assert "--cudagraph-mode" in capsys.readouterr().err
