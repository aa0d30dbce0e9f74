"""`torch.ops.infer.act_and_mul`: a gated MLP's act(gate) * up as one opaque op, so the pieces Inductor
compiles for the symbolic token count run the Triton kernel instead of Inductor's slower pointwise
lowering. CPU: the op, its fake and the eager call agree with the torch formula; traced models carry
the op. GPU: the kernel against a float64 reference, and the compiled pieces of
a model launch it (and no Inductor activation kernel)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models
from custom_ops.linear import act_and_mul, act_and_mul_plain, run_act_and_mul
from tests.test_backend_helpers import hf_config, random_inputs, run_marked

ACTIVATIONS = ("silu", "gelu_tanh")


def reference(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """float64 act(gate) * up from the same (rounded) inputs."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(6,), (5, 2 * 70), (2, 3, 64)])
def test_op_and_eager_call_equal_the_torch_formula_on_cpu(activation, shape):
    gate_up = 3 * torch.randn(shape)
    expected = act_and_mul_plain(gate_up, activation)
    for got in (act_and_mul(gate_up, activation), torch.ops.infer.act_and_mul(gate_up, activation)):
        assert got.shape == (*shape[:-1], shape[-1] // 2) and got.is_contiguous()
        assert torch.equal(got, expected)
    torch.testing.assert_close(expected, reference(gate_up, activation).float(), rtol=1e-5, atol=1e-5)


def test_bad_activation_or_odd_width_is_named_by_the_op_and_its_fake():
    with pytest.raises(ValueError, match="activation 'relu'"):
        act_and_mul(torch.randn(2, 8), "relu")
    with pytest.raises(ValueError, match=r"gate_up \(2, 7\) must end in an even size"):
        torch.ops.infer.act_and_mul(torch.randn(2, 7), "silu")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), pytest.raises(ValueError, match=r"gate_up \(4, 9\)"):
        torch.ops.infer.act_and_mul(torch.empty(4, 9), "silu")


def test_a_traced_gated_mlp_carries_the_op():
    """Dynamo traces the model's act_and_mul as the op, not its activation's aten calls."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: act_and_mul(x, "silu") * 2, backend=capture, fullgraph=True)
    x = torch.randn(4, 16)
    torch.testing.assert_close(fn(x), act_and_mul_plain(x, "silu") * 2)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.infer.act_and_mul in targets  # Dynamo records the packet, make_fx the overload
    assert F.silu not in targets


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_the_float64_reference_on_cuda(activation, dtype):
    torch.manual_seed(0)
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    wide = 4 * torch.randn(9, 2 * 8192 + 64, device="cuda", dtype=dtype)
    cases = [
        4 * torch.randn(1, 2 * 8192, device="cuda", dtype=dtype),
        4 * torch.randn(300, 2 * 70, device="cuda", dtype=dtype),       # K not a power of two
        4 * torch.randn(2, 5, 2 * 1152, device="cuda", dtype=dtype),    # a leading batch dim
        wide[:, : 2 * 8192],                                            # rows strided past their end
    ]
    for gate_up in cases:
        got = run_act_and_mul(gate_up, activation)
        assert got.shape == (*gate_up.shape[:-1], gate_up.shape[-1] // 2) and got.is_contiguous()
        torch.testing.assert_close(got.double(), reference(gate_up, activation), rtol=tol, atol=tol,
                                   msg=f"{tuple(gate_up.shape)} {dtype} {activation}")
        # rounded as the model's torch code rounds: at most one unit in the last place apart
        torch.testing.assert_close(got, act_and_mul_plain(gate_up, activation), rtol=tol / 2, atol=tol / 2)
    empty = torch.empty(0, 16, device="cuda", dtype=dtype)
    assert run_act_and_mul(empty, activation).shape == (0, 8)


@pytest.mark.gpu
def test_compiled_pieces_launch_the_kernel_and_no_inductor_activation():
    """A gated-MLP model under the backend with Inductor pieces, run without a graph (what a capture
    records): the act-and-mul is the Triton kernel, and the result agrees with eager."""
    from compile_backend import BackendConfig, InferGraphsBackend
    from custom_ops import RuntimeMode, forward_context

    torch._dynamo.reset()
    model = models.from_config(hf_config("llama", head_dim=16), dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(model, backend=InferGraphsBackend(BackendConfig()), fullgraph=True)
    ids, positions = random_inputs(40, 96, "cuda")
    with torch.no_grad():
        with forward_context(None, RuntimeMode.NONE, 40):
            run_marked(compiled, ids, positions)  # compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with forward_context(None, RuntimeMode.NONE, 40):
                got = run_marked(compiled, ids, positions)
            torch.cuda.synchronize()
        expected = model(ids, positions)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    layers = model.config.num_layers
    assert sum("_act_mul_kernel" in n for n in names) == layers, names
    assert not [n for n in names if "silu" in n], names
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
