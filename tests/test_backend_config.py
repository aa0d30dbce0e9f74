"""BackendConfig validation, default capture sizes, padding, the piecewise context helper."""
from __future__ import annotations

import pytest
import torch

import compile_backend
from compile_backend import BackendConfig, default_capture_sizes, pad_to_capture_size, piecewise_context
from custom_ops import RuntimeMode, get_forward_context


def test_default_capture_sizes_are_dense_at_small_sizes_and_include_the_max():
    sizes = BackendConfig().capture_sizes
    assert sizes[:6] == (1, 2, 4, 8, 12, 16)
    assert sizes[-1] == 512 == BackendConfig().max_capture_size
    assert list(sizes) == sorted(set(sizes))
    steps = {b - a for a, b in zip(sizes, sizes[1:]) if a >= 256}
    assert steps == {32}
    assert len(default_capture_sizes(1024)) == 48  # the engine's default budget: 48 piecewise captures


def test_engine_and_backend_share_one_default_capture_size_rule():
    from engine.config import EngineConfig
    config = EngineConfig(device="cpu", max_num_batched_tokens=2048).resolve()
    assert config.prefill_graph_sizes == default_capture_sizes(2048) == BackendConfig(max_capture_size=2048).capture_sizes
    assert default_capture_sizes(2048)[-3:] == (1792, 1920, 2048)


@pytest.mark.parametrize("max_size", [1, 3, 100, 300, 513, 1000])
def test_an_off_stride_max_is_always_captured(max_size):
    sizes = default_capture_sizes(max_size)
    assert sizes[-1] == max_size
    assert BackendConfig(max_capture_size=max_size).capture_sizes == sizes


def test_explicit_capture_sizes_are_sorted_and_deduplicated():
    config = BackendConfig(capture_sizes=[16, 4, 4, 1])
    assert config.capture_sizes == (1, 4, 16)
    assert config.max_capture_size == 16


@pytest.mark.parametrize("kwargs, field", [
    (dict(piece_compiler="tvm"), "piece_compiler"),
    (dict(splitting_ops="infer::attention"), "splitting_ops"),
    (dict(splitting_ops=("attention",)), "splitting_ops"),
    (dict(capture_sizes=()), "capture_sizes"),
    (dict(capture_sizes=(0, 8)), "capture_sizes"),
    (dict(capture_sizes=(2.5,)), "capture_sizes"),
    (dict(capture_sizes=(8, 16), max_capture_size=32), "max_capture_size"),
    (dict(max_capture_size=0), "max_capture_size"),
    (dict(cudagraphs="yes"), "cudagraphs"),
    (dict(debug_checks=1), "debug_checks"),
    (dict(pdl="on"), "pdl"),
])
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=f"BackendConfig.{field}"):
        BackendConfig(**kwargs)


def test_replace_revalidates_and_rederives_sizes():
    config = BackendConfig(max_capture_size=64).replace(piece_compiler="eager")
    assert config.piece_compiler == "eager" and config.max_capture_size == 64
    assert BackendConfig().replace(capture_sizes=(1, 2)).max_capture_size == 2
    with pytest.raises(ValueError, match="piece_compiler"):
        BackendConfig().replace(piece_compiler="nope")
    with pytest.raises(TypeError, match="no field"):
        BackendConfig().replace(graphs=False)


def test_pad_to_capture_size_rounds_up_or_gives_none_past_the_max():
    config = BackendConfig(capture_sizes=(1, 2, 4, 8, 24))
    assert [pad_to_capture_size(n, config) for n in (1, 3, 5, 8, 9, 24)] == [1, 4, 8, 8, 24, 24]
    assert pad_to_capture_size(25, config) is None
    assert pad_to_capture_size(257) == 288 and pad_to_capture_size(512) == 512
    assert pad_to_capture_size(513) is None
    with pytest.raises(ValueError, match="num_tokens"):
        pad_to_capture_size(0)


def test_piecewise_context_sets_mode_and_token_count_and_does_not_nest():
    with piecewise_context(24) as context:
        assert get_forward_context() is context
        assert context.runtime_mode is RuntimeMode.PIECEWISE and context.num_tokens == 24
        with pytest.raises(RuntimeError, match="nest"):
            with piecewise_context(8):
                pass
    assert get_forward_context() is None
    with piecewise_context(4, mode=RuntimeMode.NONE) as context:
        assert context.runtime_mode is RuntimeMode.NONE


def test_backend_rejects_a_config_of_the_wrong_type():
    with pytest.raises(TypeError, match="BackendConfig"):
        compile_backend.InferGraphsBackend({"piece_compiler": "eager"})


def test_an_inductor_backend_on_cuda_starts_the_compile_workers_before_the_trace(monkeypatch):
    """As torch's own inductor backend does: the Triton compile workers start while Dynamo traces."""
    import torch._inductor.async_compile as async_compile

    from compile_backend import BackendConfig, InferGraphsBackend
    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    InferGraphsBackend(BackendConfig(piece_compiler="eager"))
    assert calls == []
    InferGraphsBackend(BackendConfig())
    assert calls == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    InferGraphsBackend(BackendConfig())  # the CPU compiles C++ in-process: no Triton workers
    assert calls == [1]


@pytest.mark.parametrize("config, env, expected", [
    (dict(), None, True), (dict(pdl=False), None, False), (dict(), "0", False), (dict(), "1", True)])
def test_inductor_compiles_with_programmatic_dependent_launch_unless_turned_off(monkeypatch, config, env, expected):
    """Inductor emits PDL code only while the backend compiles, as BackendConfig.pdl and INFER_GRAPHS_PDL
    say; the process-wide Inductor setting is left as it was."""
    from torch._inductor import config as inductor_config

    from compile_backend import BackendConfig, InferGraphsBackend
    if not hasattr(inductor_config.triton, "enable_pdl"):
        pytest.skip("this torch's Inductor has no PDL option")
    if env is None:
        monkeypatch.delenv("INFER_GRAPHS_PDL", raising=False)
    else:
        monkeypatch.setenv("INFER_GRAPHS_PDL", env)
    before = inductor_config.triton.enable_pdl
    seen = []
    monkeypatch.setattr(InferGraphsBackend, "_compile",
                        lambda self, gm, inputs: seen.append(inductor_config.triton.enable_pdl) or "compiled")
    assert InferGraphsBackend(BackendConfig(**config))(None, []) == "compiled"
    assert seen == [expected]
    assert inductor_config.triton.enable_pdl == before
