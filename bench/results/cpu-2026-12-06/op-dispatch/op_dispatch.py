"""What one call of a do-nothing torch op costs through the dispatcher, registered as
`torch.library.custom_op` does it and as custom_ops.registry.infer_op does it, under inference_mode
(as the engine runs). Usage: PYTHONPATH=. python bench/results/cpu-2026-12-06/op-dispatch/op_dispatch.py"""
import statistics
import time

import torch

from custom_ops.registry import infer_op


@torch.library.custom_op("dispatch_probe::mutating", mutates_args=("out",))
def custom_mutating(x: torch.Tensor, out: torch.Tensor) -> None:
    pass


@torch.library.custom_op("dispatch_probe::functional", mutates_args=())
def custom_functional(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0)


@infer_op("dispatch_probe_mutating", mutates_args=("out",))
def lib_mutating(x: torch.Tensor, out: torch.Tensor) -> None:
    pass


@infer_op("dispatch_probe_functional")
def lib_functional(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0)


def per_call_us(fn, *args, n=20000, repeats=7):
    for _ in range(1000):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn(*args)
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


with torch.inference_mode():
    x, out = torch.randn(4), torch.empty(4)
    rows = [("custom_op, mutating", per_call_us(torch.ops.dispatch_probe.mutating.default, x, out)),
            ("custom_op, returns a tensor", per_call_us(torch.ops.dispatch_probe.functional.default, x)),
            ("infer_op, mutating", per_call_us(torch.ops.infer.dispatch_probe_mutating.default, x, out)),
            ("infer_op, returns a tensor", per_call_us(torch.ops.infer.dispatch_probe_functional.default, x)),
            ("the Python function itself", per_call_us(lib_mutating._fn, x, out))]
print(f"torch {torch.__version__}; median of 7 x 20,000 calls")
for name, us in rows:
    print(f"| {name} | {us:.2f} us |")
