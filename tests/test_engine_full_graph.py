"""EngineConfig.full_graph_compile="unsplit": FULL steps run one Inductor graph with the attention op
inside, and it decodes exactly like the split pieces.

On the CPU there is no decode graph, so the test stands the eager decode-graph stand-in of
test_engine_generate in for it and runs the unsplit variant under the FULL forward context, as the
decode capture does on CUDA. Every FULL step is run by both variants over the same static buffers
and KV pool and their logits compared; the tokens must equal those of the split pieces.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from custom_ops import RuntimeMode
from engine import LLM, ConfigError, SamplingParams
from engine.compile import compile_model
from engine.dispatch import Dispatcher
from tests.hf_helpers import random_hf_model
from tests.test_engine_generate import ARCHS, COMMON, PROMPTS, SMALL, _EagerDecodeGraphs


class _BothVariants(_EagerDecodeGraphs):
    """Each FULL step through the split pieces (the reference) and then the unsplit variant."""

    def __init__(self, runner, sizes, split_forward):
        super().__init__(runner, sizes)
        self.split_forward, self.max_abs_diff, self.steps = split_forward, 0.0, 0

    def replay(self, batch_size, num_real):
        runner = self.runner
        meta = runner.buffers.metadata(batch_size, batch_size, batch_size, 1, runner.max_model_len, True)
        ids, positions = runner.buffers.input_ids[:batch_size], runner.buffers.positions[:batch_size]
        with runner.forward_context(meta, RuntimeMode.FULL, batch_size):
            # the K/V this step writes is the same in both runs (same tokens, same slots)
            reference = runner.model.compute_logits(self.split_forward(ids, positions))[:num_real]
        logits = super().replay(batch_size, num_real)  # runner.run_forward -> runner.full_forward
        self.max_abs_diff = max(self.max_abs_diff, (logits - reference).abs().max().item())
        self.steps += 1
        return logits


def test_unsplit_full_variant_decodes_like_the_split_pieces_with_out_written_in_place(tmp_path):
    torch.set_num_threads(1)
    config_cls, kwargs = ARCHS["gemma3"]  # sliding and full layers, softcap: the most for one graph to hold
    random_hf_model(config_cls(**COMMON, **kwargs), seed=7).save_pretrained(tmp_path)
    torch._dynamo.reset()
    llm = LLM(str(tmp_path), **SMALL, compile=True, piece_compiler="eager")
    runner = llm.runtime.runner
    runner.dispatcher = Dispatcher((2, 4), (), decode_graphs_wanted=True)
    runner.decode_graphs = _EagerDecodeGraphs(runner, (2, 4))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]

    from torch._dynamo.utils import ReinplaceCounters
    ReinplaceCounters.clear()
    unsplit, _, backend = compile_model(llm.model, dataclasses.replace(llm.config, piece_compiler="inductor"),
                                        unsplit=True)
    runner.full_forward = unsplit
    runner.decode_graphs = both = _BothVariants(runner, (2, 4), runner.forward)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert both.steps > 0 and both.max_abs_diff < 1e-4
    summary = backend.split_summary()
    assert summary.num_compute_pieces == 1 and summary.num_splitting_pieces == 0
    assert backend.stats.graphs_compiled == 1 and backend.stats.full_steps == both.steps
    assert llm.stats()["backend"]["graphs_compiled"] == 1  # two compiles of one model, one trace each
    # Inductor reinplaced the attention op's `out` (a clone would cost a copy per layer)
    assert ReinplaceCounters.get_total_missed() == 0
    runner.decode_graphs = None  # the stand-in has no graphs to release
    llm.close()


def test_full_graph_compile_names_its_choices():
    with pytest.raises(ConfigError, match="EngineConfig.full_graph_compile='split' is invalid: expected one of "
                                          "unsplit, piecewise"):
        LLM(torch.nn.Linear(2, 2), full_graph_compile="split")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gpu_unsplit_decode_graphs_give_the_tokens_of_the_piecewise_ones(tmp_path, arch):
    from tests.test_engine_gpu import WORKLOAD, _build_hf, _engine, _run_workload
    _build_hf(arch).save_pretrained(tmp_path)
    results = {}
    for variant in ("piecewise", "unsplit"):
        llm = _engine(tmp_path, cuda_graphs=True, full_graph_compile=variant)
        results[variant] = _run_workload(llm, WORKLOAD)
        stats = llm.stats()
        assert stats["full_graph_compile"] == variant and stats["modes"]["full"] > 0
        if variant == "unsplit":
            full = stats["full_backend"]
            assert full["graphs_compiled"] == 1 and full["splitting_pieces"] == 0 and full["full_steps"] > 0
            assert stats["backend"]["full_steps"] == 0  # the split pieces never ran a FULL step
        llm.close()
    assert results["unsplit"] == results["piecewise"]
