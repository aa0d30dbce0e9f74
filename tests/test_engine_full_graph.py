"""EngineConfig.full_graph_compile "layered" and "unsplit": FULL steps run Inductor graphs with the
attention op inside (one per layer, identical layers compiled once; or one for the whole forward),
compiled from the same Dynamo trace as the pieces, and they decode exactly like the pieces.

On the CPU there is no decode graph, so the test stands the eager decode-graph stand-in of
test_engine_generate in for it and runs the compiled model under the FULL forward context, as the
decode capture does on CUDA. Every FULL step is run by the split pieces and by the unsplit graph
over the same static buffers and KV pool and their logits compared; the tokens must equal those of
the split pieces.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from custom_ops import RuntimeMode
from engine import LLM, ConfigError, SamplingParams
from engine.worker.compile import compile_model
from engine.worker.dispatch import Dispatcher
from tests.hf_helpers import random_hf_model
from tests.test_engine_generate import ARCHS, COMMON, PROMPTS, SMALL, _EagerDecodeGraphs


class _BothVariants(_EagerDecodeGraphs):
    """Each FULL step through the split pieces (the reference, and what the engine keeps) and
    through the unsplit graph of another compile of the model."""

    def __init__(self, runner, sizes, unsplit):
        super().__init__(runner, sizes)
        self.unsplit, self.max_abs_diff, self.steps = unsplit, 0.0, 0

    def replay(self, batch_size, num_real):
        runner = self.runner
        meta = runner.buffers.metadata(batch_size, batch_size, batch_size, 1, runner.max_model_len, True)
        ids, positions = runner.buffers.input_ids[:batch_size], runner.buffers.positions[:batch_size]
        with runner.forward_context(meta, RuntimeMode.FULL, batch_size):
            # the K/V this step writes is the same in both runs (same tokens, same slots)
            unsplit = runner.model.compute_logits(self.unsplit(ids, positions))[:num_real]
        reference = super().replay(batch_size, num_real)  # runner.run_forward: the split pieces
        self.max_abs_diff = max(self.max_abs_diff, (unsplit - reference).abs().max().item())
        self.steps += 1
        return reference


@pytest.mark.parametrize("variant", ["layered", "unsplit"])
def test_full_step_code_comes_from_the_pieces_trace_and_decodes_like_them(tmp_path, variant):
    torch.set_num_threads(1)
    config_cls, kwargs = ARCHS["gemma3"]  # sliding and full layers, softcap: the most for one graph to hold
    random_hf_model(config_cls(**COMMON, **kwargs), seed=7).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **SMALL, compile=True, piece_compiler="eager")
    runner = llm.runtime.runner
    runner.dispatcher = Dispatcher((2, 4), (), decode_graphs_wanted=True)
    runner.decode_graphs = _EagerDecodeGraphs(runner, (2, 4))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]

    from torch._dynamo.utils import ReinplaceCounters
    ReinplaceCounters.clear()
    # the CPU config resolved cuda_graphs off; the compile is asked for what a CUDA engine gets
    config = dataclasses.replace(llm.config, piece_compiler="inductor", cuda_graphs=True, cudagraph_mode=None,
                                 full_graph_compile=variant)
    unsplit, _, backend = compile_model(llm.model, config)
    runner.decode_graphs = both = _BothVariants(runner, (2, 4), unsplit)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert both.steps > 0 and both.max_abs_diff < 1e-4
    # one Dynamo trace: the pieces and the FULL-step code
    stats = backend.stats
    assert stats.graphs_compiled == 1
    layers = llm.model.config.num_layers
    if variant == "unsplit":
        assert stats.full_graph_pieces == 1 and stats.full_graph_compilations == 1
    else:
        # one graph per attention layer plus the tail; the middle layers (a sliding and a full one:
        # the layer the op computes is resolved when it runs) share one compile, so 3 in all
        assert stats.full_graph_pieces == layers + 1 and stats.full_graph_compilations == 3
    assert backend.stats.full_steps == both.steps and backend.stats.graphless_steps == 0
    # Inductor reinplaced the attention op's `out` (a clone would cost a copy per layer)
    assert ReinplaceCounters.get_total_missed() == 0
    unsplit.release()
    runner.decode_graphs = None  # the stand-in has no graphs to release
    llm.close()


def test_full_graph_compile_names_its_choices():
    with pytest.raises(ConfigError, match="EngineConfig.full_graph_compile='split' is invalid: expected None or "
                                          "one of layered, unsplit, piecewise"):
        LLM(torch.nn.Linear(2, 2), full_graph_compile="split")


def test_full_graph_compile_defaults_to_the_pieces_when_prefill_graphs_replay_them():
    from engine.config import EngineConfig, default_full_graph_compile
    assert default_full_graph_compile(True) == "piecewise"
    assert default_full_graph_compile(False) == "layered"
    # on the CPU prefill graphs are off, so the pieces keep their plain matmuls
    assert EngineConfig(device="cpu").resolve().full_graph_compile == "layered"
    assert EngineConfig(device="cpu", full_graph_compile="unsplit").resolve().full_graph_compile == "unsplit"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gpu_unsplit_decode_graphs_give_the_tokens_of_the_piecewise_ones(tmp_path, arch):
    from tests.test_engine_generate import _build_hf
    from tests.test_engine_gpu import WORKLOAD, _engine, _run_workload
    _build_hf(arch).save_pretrained(tmp_path)
    results = {}
    for variant in ("piecewise", "unsplit", "layered"):
        llm = _engine(tmp_path, cuda_graphs=True, full_graph_compile=variant)
        results[variant] = _run_workload(llm, WORKLOAD)
        stats = llm.stats()
        assert stats["full_graph_compile"] == variant and stats["modes"]["full"] > 0
        backend = stats["backend"]
        # one Dynamo trace either way; "unsplit" compiles it once more, whole, for FULL steps,
        # "layered" once per distinct layer
        assert backend["graphs_compiled"] == 1
        assert backend["full_graph_pieces"] == {"piecewise": 0, "unsplit": 1,
                                                "layered": llm.model.config.num_layers + 1}[variant]
        llm.close()
    assert results["unsplit"] == results["piecewise"]
    assert results["layered"] == results["piecewise"]
