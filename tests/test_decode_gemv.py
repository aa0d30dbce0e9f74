"""The batch-1 decode GEMV switch (EngineConfig.decode_gemv) on the CPU: `torch.ops.infer.linear`
passes opcheck and equals F.linear wherever it does not pick the GEMV; the choice is the measured
table's shapes at one row on CUDA in bf16/fp16 and nothing else; the wrapper around the kernel (rows,
bias, `out`) is right, run in Triton's interpreter; a model switched on traces the op for every
matmul and a model switched off traces exactly F.linear; eager calls skip the dispatcher; the
compiled pieces keep the op for the graphs that record them; row-parallel layers
still all-reduce; an engine without decode graphs leaves the model alone; the flags parse."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import custom_ops.linear
import models
from bench.configs import TINY_LLAMA
from custom_ops import (
    GEMV_CONFIGS, GemvConfig, gemv_config, run_gated_linear, run_linear,
)
from custom_ops.linear import act_and_mul_plain
from engine import LLM, ConfigError, EngineConfig, SamplingParams
from engine.entrypoints.cli_args import OneLineErrorParser, add_engine_args, engine_config_fields
from models.layers import Linear
from models.parallel import TensorParallel

LLAMA_3B_SHAPES = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (128256, 3072)]
QWEN3_4B_SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560)]
GEMMA3_1B_SHAPES = [(1536, 1152), (1152, 1024), (13824, 1152), (1152, 6912), (262144, 1152)]
MEASURED_SHAPES = LLAMA_3B_SHAPES + QWEN3_4B_SHAPES + GEMMA3_1B_SHAPES
SM90 = (9, 0)  # the H100's compute capability: the tables were measured there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape", [(1, 24), (5, 24), (2, 3, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_op_passes_opcheck_and_is_f_linear_on_cpu(dtype, x_shape, bias):
    x, weight = torch.randn(x_shape, dtype=dtype), torch.randn(40, 24, dtype=dtype)
    b = torch.randn(40, dtype=dtype) if bias else None
    torch.library.opcheck(torch.ops.infer.linear.default, (x, weight, b))
    assert torch.equal(torch.ops.infer.linear(x, weight, b), F.linear(x, weight, b))


def test_gemv_is_picked_only_for_the_measured_shapes_at_one_row_on_cuda_in_16_bits():
    from custom_ops.gemv_table import SKINNY_CONFIGS
    assert sorted(GEMV_CONFIGS) == sorted(MEASURED_SHAPES)
    for n, k in MEASURED_SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            assert gemv_config(1, n, k, dtype, "cuda", capability=SM90) is GEMV_CONFIGS[(n, k)]
        for rows in (2, 8):  # above one row the GEMV lost: the skinny table's choice or cuBLAS, never it
            assert gemv_config(rows, n, k, torch.bfloat16, "cuda", capability=SM90) is SKINNY_CONFIGS.get((n, k), {}).get(8)
        assert gemv_config(1, n, k, torch.float32, "cuda", capability=SM90) is None
        assert gemv_config(1, n, k, torch.bfloat16, "cpu") is None
    assert gemv_config(1, 2560, 2560, torch.bfloat16, "cuda", capability=SM90) is None  # qwen3-4b's o: not measured, cuBLAS
    assert all(isinstance(c, GemvConfig) for c in GEMV_CONFIGS.values())


def test_untuned_shapes_are_every_split_shape_of_a_tensor_parallel_rank_and_none_of_one_gpus():
    """What start-up reports (stats()["startup"]["gemv_untuned"] and one log line): the shapes that run
    cuBLAS at batch 1 for want of an entry; one GPU's llama / qwen3 / gemma have none, a rank of
    2-way tensor parallelism has nothing but them until its graph is swept."""
    from bench.gemm import model_gemm_shapes
    from custom_ops.gemv_table import untuned_shapes
    for model in ("llama-3.2-3b", "qwen3-4b", "gemma-3-1b"):
        whole = [(n, k) for _, n, k in model_gemm_shapes(model)]
        split = [(n, k) for _, n, k in model_gemm_shapes(model, tp_size=2)]
        assert untuned_shapes(whole, torch.bfloat16, capability=SM90) == []
        assert untuned_shapes(split, torch.bfloat16, capability=SM90) == split
        assert untuned_shapes(split, torch.float32, capability=SM90) == []  # no GEMV in fp32 anyway


def test_start_up_notes_and_logs_a_models_untuned_shapes_once(monkeypatch, caplog):
    from custom_ops import gemv_table
    from engine.worker import startup
    from engine.worker.timeline import StartupTimeline
    monkeypatch.setattr(gemv_table, "device_capability", lambda index=None: SM90)
    model = models.from_config(TINY_LLAMA, dtype=torch.bfloat16, device="cpu")
    monkeypatch.setitem(gemv_table.GEMV_CONFIGS, tuple(model.model.layers[0].mlp.down_proj.weight.shape), GemvConfig())
    timeline = StartupTimeline()
    with caplog.at_level("INFO", logger="engine"):
        startup._note_untuned_matmuls(model, torch.device("cuda", 0), timeline)
    # qkv, o, gate_up and the tied LM head (gate_up's shape here: listed once), the down projection tuned
    assert timeline.notes["gemv_untuned"] == ["128x64", "64x64", "256x64"]
    assert "3 of 4 shapes have no GEMV tuning on this GPU and run cuBLAS at batch 1 (128x64, 64x64, 256x64)" in caplog.text


def test_a_gpu_without_tuning_for_its_compute_capability_runs_cublas_and_says_so_once(monkeypatch, caplog):
    import logging

    from custom_ops import gemv_table
    monkeypatch.setattr(gemv_table, "_by_capability", {})
    with caplog.at_level(logging.WARNING, logger="custom_ops"):
        for ampere in ((8, 0), (8, 0), (8, 9)):  # an A100 twice, then an L40S
            for n, k in MEASURED_SHAPES:
                assert gemv_config(1, n, k, torch.bfloat16, "cuda", capability=ampere) is None
                assert gemv_config(16, n, k, torch.bfloat16, "cuda", capability=ampere) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # once per capability, not per call
    assert messages[0] == ("decode matmuls: no GEMV / skinny-GEMM tuning for compute capability 8.0 (tuned: 9.0): "
                           "every matmul runs on cuBLAS")
    assert gemv_table.tables_for(SM90).gemv is GEMV_CONFIGS and "H100" in gemv_table.tables_for(SM90).source


def test_a_gpu_with_tuning_says_once_whose_tables_it_runs(monkeypatch, caplog):
    """An H200 (compute capability 9.0, like the H100 the tiles were timed on) logs which tables it uses."""
    import logging

    from custom_ops import gemv_table
    monkeypatch.setattr(gemv_table, "_by_capability", {})
    with caplog.at_level(logging.INFO, logger="custom_ops"):
        for _ in range(3):
            for n, k in MEASURED_SHAPES:
                gemv_config(1, n, k, torch.bfloat16, "cuda", capability=SM90)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert messages[0].startswith("decode matmuls: the GEMV / skinny-GEMM tuning of compute capability 9.0 (")
    assert f"{len(GEMV_CONFIGS)} GEMV" in messages[0] and "measured on H100 80GB HBM3" in messages[0]


def test_the_tables_are_those_of_the_device_a_tensor_is_on(monkeypatch):
    """table_config asks for the weight's device's capability; the lookup is cached per device."""
    from custom_ops import gemv_table
    asked = []
    monkeypatch.setattr(gemv_table, "_capability_of", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (8, 6))
    assert gemv_table.device_capability(3) == (8, 6) == gemv_table.device_capability(3)
    assert asked == [3]
    assert gemv_config(1, 5120, 3072, torch.bfloat16, "cuda", device_index=3) is None  # 8.6: untuned
    gemv_table._capability_of[3] = SM90
    assert gemv_config(1, 5120, 3072, torch.bfloat16, "cuda", device_index=3) is GEMV_CONFIGS[(5120, 3072)]


@pytest.mark.parametrize("x_shape", [(1, 80), (1, 1, 80), (3, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_run_linear_with_a_gemv_choice_matches_f_linear(monkeypatch, x_shape, bias):
    """The wrapper around the kernel (rows, bias, shape) with the kernel run by Triton's interpreter:
    the table says "GEMV" for (48, 80) at one row; three rows stay on F.linear."""
    chosen = []

    def choose(rows, n, k, dtype, device_type, *_):
        chosen.append(rows)
        return GemvConfig(block_n=16, block_k=32, split_k=2, num_warps=1) if (rows, n, k) == (1, 48, 80) else None
    monkeypatch.setattr(custom_ops.linear, "gemv_config", choose)
    x, weight = torch.randn(x_shape), torch.randn(48, 80)
    b = torch.randn(48) if bias else None
    y = run_linear(x, weight, b)
    assert chosen == [x.numel() // 80]
    assert y.shape == (*x_shape[:-1], 48)
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    if not bias and x.dim() == 2:
        out = torch.full((x_shape[0], 48), float("nan"))
        assert run_linear(x, weight, out=out) is out
        torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gated_linear_with_a_gemv_choice_matches_the_unfused_code(monkeypatch, activation, split_k):
    """The activation inside the GEMV (Triton's interpreter): act(gate) * up, then the matmul."""
    monkeypatch.setattr(custom_ops.linear, "gemv_config",
                        lambda rows, n, k, dtype, device_type, *_: GemvConfig(block_n=16, block_k=32, split_k=split_k,
                                                                          num_warps=1) if rows == 1 else None)
    gate_up, weight = 2 * torch.randn(1, 160), torch.randn(48, 80)
    y = run_gated_linear(gate_up, weight, activation)
    torch.testing.assert_close(y, F.linear(act_and_mul_plain(gate_up, activation), weight), rtol=1e-4, atol=1e-4)
    rows = torch.randn(3, 160)  # more rows: the table says cuBLAS, and the CPU runs torch's code
    torch.testing.assert_close(run_gated_linear(rows, weight, activation),
                               F.linear(act_and_mul_plain(rows, activation), weight))


def test_many_row_choices_go_by_bucket_of_rows():
    """2..8 rows read bucket 8, 9..16 bucket 16, 17..32 bucket 32, 33..64 bucket 64; more than 64 rows
    cuBLAS."""
    from custom_ops.gemv_table import CUBLASLT, SKINNY_CONFIGS
    down = SKINNY_CONFIGS[(3072, 8192)]  # llama-3.2-3b's down projection has a choice in every bucket
    assert [gemv_config(r, 3072, 8192, torch.bfloat16, "cuda", capability=SM90) for r in (2, 5, 8, 9, 15, 16, 17, 24, 32, 33, 64)] == \
        [down[8]] * 3 + [down[16]] * 3 + [down[32], down[32], down[32], down[64], down[64]]
    assert down[64] == CUBLASLT
    for rows in (65, 128):
        assert gemv_config(rows, 3072, 8192, torch.bfloat16, "cuda", capability=SM90) is None
    assert gemv_config(8, 5120, 3072, torch.bfloat16, "cuda", capability=SM90) is None  # llama's qkv at 2-8 rows: cuBLAS
    assert gemv_config(32, 3072, 3072, torch.bfloat16, "cuda", capability=SM90) is None  # llama's o at 32 rows: cuBLAS won
    assert gemv_config(16, 3072, 8192, torch.float32, "cuda", capability=SM90) is None
    assert gemv_config(16, 3072, 8192, torch.bfloat16, "cpu") is None


def test_run_linear_and_gated_linear_with_a_skinny_choice_match_torch(monkeypatch):
    """The wrappers at 16-64 rows with the skinny GEMM run by Triton's interpreter: the plain matmul
    (bias, out=) and the gated one (act_mul first, then the skinny GEMM)."""
    skinny = GemvConfig(block_n=16, block_k=16, split_k=2, num_warps=1)
    monkeypatch.setattr(custom_ops.linear, "gemv_config",
                        lambda rows, n, k, dtype, device_type, *_: skinny if rows >= 16 else None)
    x, weight, bias = torch.randn(20, 80), torch.randn(48, 80), torch.randn(48)
    torch.testing.assert_close(run_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    out = torch.full((20, 48), float("nan"))
    assert run_linear(x, weight, out=out) is out
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)
    gate_up = 2 * torch.randn(17, 160)
    torch.testing.assert_close(run_gated_linear(gate_up, weight, "silu"),
                               F.linear(act_and_mul_plain(gate_up, "silu"), weight), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_mul_kernel_matches_torch(activation):
    from custom_ops.triton_gemv import act_mul
    x = 3 * torch.randn(5, 2 * 70)  # ragged: 70 is not a power of two
    torch.testing.assert_close(act_mul(x, activation), act_and_mul_plain(x, activation), rtol=1e-5, atol=1e-5)


def test_gated_linear_names_a_bad_activation_or_width():
    with pytest.raises(ValueError, match="activation 'relu'"):
        run_gated_linear(torch.randn(1, 16), torch.randn(4, 8), "relu")
    with pytest.raises(ValueError, match=r"gate_up \(1, 12\) must end in 2 \* K = 16"):
        run_gated_linear(torch.randn(1, 12), torch.randn(4, 8), "silu")
    torch.library.opcheck(torch.ops.infer.gated_linear.default, (torch.randn(2, 16), torch.randn(4, 8), "silu"))


def test_run_linear_refuses_out_with_a_bias():
    with pytest.raises(ValueError, match="no bias"):
        run_linear(torch.randn(1, 8), torch.randn(4, 8), torch.randn(4), out=torch.empty(1, 4))


def _traced_matmuls(net: torch.nn.Module) -> dict[str, int]:
    counts = {"infer.linear": 0, "infer.gated_linear": 0, "infer.linear_rope": 0, "F.linear": 0}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is F.linear:
                counts["F.linear"] += 1
            elif node.op == "call_function" and node.target in (torch.ops.infer.linear,
                                                                  torch.ops.infer.linear.default):
                counts["infer.linear"] += 1
            elif node.op == "call_function" and node.target in (torch.ops.infer.gated_linear,
                                                                  torch.ops.infer.gated_linear.default):
                counts["infer.gated_linear"] += 1
            elif node.op == "call_function" and node.target in (torch.ops.infer.linear_rope,
                                                                  torch.ops.infer.linear_rope.default):
                counts["infer.linear_rope"] += 1
        return gm.forward
    torch._dynamo.reset()
    step = torch.compile(lambda ids, pos: net.compute_logits(net(ids, pos)), backend=backend, fullgraph=True)
    with torch.no_grad():
        step(torch.tensor([1, 5, 9]), torch.arange(3))
    torch._dynamo.reset()
    return counts


def test_set_decode_gemv_traces_the_op_for_every_matmul_and_plain_f_linear_when_off():
    net = models.from_config(TINY_LLAMA, dtype="float32", device="cpu", seed=0)
    layers = TINY_LLAMA["num_hidden_layers"]
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    assert models.set_decode_gemv(net, True) == len(linears) + 1  # and the model's own logits matmul
    assert all(m.decode_gemv for m in linears) and net.decode_gemv
    # o, gate_up per layer, and the tied-embedding logits; down with the activation in it; qkv with
    # its rotary (Llama has no q/k norms)
    assert _traced_matmuls(net) == {"infer.linear": 2 * layers + 1, "infer.gated_linear": layers,
                                    "infer.linear_rope": layers, "F.linear": 0}
    models.set_decode_gemv(net, False)
    assert not any(m.decode_gemv for m in linears) and not net.decode_gemv
    assert _traced_matmuls(net) == {"infer.linear": 0, "infer.gated_linear": 0, "infer.linear_rope": 0,
                                    "F.linear": 4 * layers + 1}


class RecordingTP(TensorParallel):
    """Two ranks, this one rank 0; all_reduce records its input and "adds" an identical partial."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(x.clone())
        return x + x


def _switched_linear(in_features: int, out_features: int, **kwargs) -> Linear:
    """A Linear with a bias, random weights, and decode_gemv on."""
    layer = Linear(in_features, out_features, True, torch.float32, **kwargs)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.decode_gemv = True
    return layer


def test_row_parallel_linear_with_the_op_still_all_reduces_before_its_bias():
    tp = RecordingTP(rank=0, world_size=2, group=object())
    tp.reduced = []
    layer = _switched_linear(16, 6, tp=tp, input_parallel=True)
    x = torch.randn(1, 8)
    with torch.no_grad():
        y = layer(x)
    partial = F.linear(x, layer.weight)
    assert len(tp.reduced) == 1 and torch.equal(tp.reduced[0], partial)  # the bias is not in the sum
    torch.testing.assert_close(y, 2 * partial + layer.bias)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_row_parallel_gated_projection_all_reduces_before_its_bias(activation):
    """The gated down projection of a rank's shard: its partial product is what is summed, the bias is
    added once after the sum, as Linear.forward does."""
    tp = RecordingTP(rank=0, world_size=2, group=object())
    tp.reduced = []
    layer = _switched_linear(16, 6, tp=tp, input_parallel=True)  # this rank holds 8 of 16 input features
    gate_up = torch.randn(1, 16)  # [gate 8 | up 8] of this rank's intermediate columns
    with torch.no_grad():
        y = layer.gated(gate_up, activation)
    partial = F.linear(act_and_mul_plain(gate_up, activation), layer.weight)
    assert len(tp.reduced) == 1
    torch.testing.assert_close(tp.reduced[0], partial)
    torch.testing.assert_close(y, 2 * partial + layer.bias)


def _linear_targets(gm: torch.fx.GraphModule) -> list[str]:
    names = {torch.ops.infer.linear: "infer.linear", torch.ops.infer.linear.default: "infer.linear",
             torch.ops.aten.linear.default: "aten.linear", F.linear: "F.linear",
             torch.ops.infer.gated_linear: "infer.gated_linear", torch.ops.infer.gated_linear.default: "infer.gated_linear",
             torch.ops.infer.linear_rope: "infer.linear_rope", torch.ops.infer.linear_rope.default: "infer.linear_rope"}
    return [names[n.target] for n in gm.graph.nodes if n.op == "call_function" and n.target in names]


@pytest.mark.usefixtures("one_thread")
def test_the_compiled_pieces_keep_the_op_for_the_graphs_that_record_them():
    """Decode graphs record the pieces run straight through (RuntimeMode.FULL), so every matmul of a
    switched-on model must still be the op there; a step without a graph runs the same pieces."""
    from compile_backend import BackendConfig, InferGraphsBackend
    from custom_ops import RuntimeMode, forward_context

    net = models.from_config(TINY_LLAMA, dtype="float32", device="cpu", seed=0)
    layers = TINY_LLAMA["num_hidden_layers"]
    models.set_decode_gemv(net, True)
    ids, pos = torch.tensor([1, 5, 9]), torch.arange(3)
    with torch.no_grad():
        expected = net(ids, pos)
    backend = InferGraphsBackend(BackendConfig(piece_compiler="eager", cudagraphs=False))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(net, backend=backend, fullgraph=True, dynamic=False)
        with torch.no_grad(), forward_context(None, RuntimeMode.NONE, 3):
            torch.testing.assert_close(compiled(ids, pos), expected)
        with torch.no_grad(), forward_context(None, RuntimeMode.FULL, 3):
            torch.testing.assert_close(compiled(ids, pos), expected)
        graph = backend.graphs[0]
        fns = [getattr(piece, "fn", None) for piece in graph.pieces]  # the eager compiler's FX modules
        pieces = [f.__self__ for f in fns if isinstance(getattr(f, "__self__", None), torch.fx.GraphModule)]
        assert len(pieces) > layers  # compute pieces between the attention calls
        assert sorted(sum((_linear_targets(p) for p in pieces), [])) == sorted(
            ["infer.linear_rope", "infer.linear", "infer.linear", "infer.gated_linear"] * layers)
        assert backend.stats.full_steps == 1 and backend.stats.graphless_steps == 1
    finally:
        models.set_decode_gemv(net, False)
        torch._dynamo.reset()


def test_eager_linears_call_the_implementation_without_the_dispatcher(monkeypatch):
    calls = []
    real = custom_ops.linear.decode_linear
    monkeypatch.setattr(torch.ops.infer, "linear", lambda *a: calls.append(1) or real(*a), raising=False)
    layer = _switched_linear(24, 40)
    x = torch.randn(1, 24)
    with torch.no_grad():
        y = layer(x)
    assert calls == []
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))


@pytest.mark.usefixtures("one_thread")
def test_an_engine_without_decode_graphs_leaves_every_matmul_plain(monkeypatch):
    """Nothing would record the GEMV (the CPU has no graphs): the model is not switched, the op is
    never called, and the tokens are those of decode_gemv=False."""
    calls = []
    real = custom_ops.linear.run_linear
    monkeypatch.setattr(custom_ops.linear, "run_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    net = models.from_config(TINY_LLAMA, dtype="float32", device="cpu", seed=0)
    prompts = [[1, 5, 9, 13, 17], [1, 40, 41]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        torch._dynamo.reset()
        with LLM(net, device="cpu", decode_gemv=on, compile=True, piece_compiler="eager", block_size=4,
                 max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, show_progress=False) as llm:
            assert not any(m.decode_gemv for m in net.modules() if isinstance(m, Linear))
            tokens[on] = [out.token_ids for out in llm.generate(prompts, params)]
    torch._dynamo.reset()
    assert calls == []
    assert all(len(t) == 5 for t in tokens[True])
    assert tokens[True] == tokens[False]


def test_decode_gemv_flag_parses_and_the_field_is_validated():
    parser = OneLineErrorParser()
    add_engine_args(parser)
    assert engine_config_fields(parser.parse_args(["--decode-gemv"])) == {"decode_gemv": True}
    assert engine_config_fields(parser.parse_args(["--no-decode-gemv"])) == {"decode_gemv": False}
    assert "decode_gemv" not in engine_config_fields(parser.parse_args([]))  # EngineConfig's default: on
    assert EngineConfig().decode_gemv is True
    with pytest.raises(ConfigError, match="decode_gemv"):
        EngineConfig(decode_gemv="yes")
