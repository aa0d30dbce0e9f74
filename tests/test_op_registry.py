"""custom_ops.registry: every torch.ops.infer op is registered on a torch.library.Library with a
CompositeExplicitAutograd kernel and a fake implementation (none through torch.library.custom_op, whose
per-call Python wrapper the no-graph path would pay ~8 times a layer), and a registered op computes
what its function computes. The ops' own opcheck tests live beside each op (test_add_rms_norm.py,
test_attention_op.py, test_decode_gemv.py, ...)."""
from __future__ import annotations

import torch
import torch._library.custom_ops as torch_custom_ops

import custom_ops  # noqa: F401  (registers the ops)
from custom_ops.registry import InferOp, infer_op

EXPECTED = {"infer::attention", "infer::all_reduce", "infer::act_and_mul", "infer::gated_linear", "infer::linear",
            "infer::add_rms_norm", "infer::linear_rope", "infer::qk_norm_rope"}


def _infer_ops() -> set[str]:
    return {name.split(".")[0] for name in torch._C._dispatch_get_all_op_names() if name.startswith("infer::")}


def test_every_infer_op_has_a_composite_kernel_a_fake_and_no_custom_op_wrapper():
    ops = _infer_ops()
    assert EXPECTED <= ops, EXPECTED - ops
    for name in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"), name  # the fake
    assert not [name for name in torch_custom_ops.OPDEFS if name in EXPECTED]


def test_a_registered_op_runs_its_function_and_its_fake_under_fake_tensors():
    calls = []

    @infer_op("registry_test_scale", mutates_args=("out",))
    def scale(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        calls.append(factor)
        out.copy_(x * factor)

    @scale.register_fake
    def _(x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        return None

    assert isinstance(scale, InferOp) and scale.qualname == "infer::registry_test_scale"
    schema = str(torch.ops.infer.registry_test_scale.default._schema)
    assert schema == "infer::registry_test_scale(Tensor x, Tensor(a1!) out, float factor) -> ()"
    x, out = torch.randn(5), torch.empty(5)
    scale(x, out, 3.0)
    torch.testing.assert_close(out, x * 3.0)
    assert calls == [3.0]
    torch.library.opcheck(torch.ops.infer.registry_test_scale.default, (x, torch.empty(5), 2.0))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fx, fout = mode.from_tensor(x), mode.from_tensor(out)
        before = len(calls)
        torch.ops.infer.registry_test_scale(fx, fout, 4.0)
        assert len(calls) == before  # the fake ran, not the function
