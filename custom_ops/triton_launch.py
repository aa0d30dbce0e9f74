"""`launch(kernel, grid, args, options)`: a @triton.jit kernel launched again at a quarter of the host
cost of `kernel[grid](*args, **options)`.

Between two piecewise graphs the attention op's kernel launch is host time the GPU waits for. At 64
tokens, llama-3.2-3b's 28 prefill launches took 1.38 ms of a 3.2 ms step's host time on an H100 host
(triton 3.6): ~49 us each, of which the compiled launcher (`CompiledKernel.run`) is ~11 us. The rest is
JITFunction.run deriving again, on every call, the specialization it compiled for (each argument's
type, each pointer's 16-byte alignment, each integer's divisibility by 16 and equality to 1) and
looking it up.

Here each kernel keeps its compiled variants under a key that fixes that specialization: every
non-tensor argument's value (an integer's value fixes its type, divisibility and equality to 1), every
tensor's dtype and 16-byte alignment, the keyword arguments (constexprs and launch options, which a
call site passes in one order) and the device. A miss goes through `kernel[grid](...)`, which compiles
where Triton must and returns the compiled kernel; a hit calls that kernel's launcher with the
argument list JITFunction.run would pass it: every parameter in signature order.

The direct call is taken only where that list is known: the positional arguments are the leading
parameters, every later parameter is a keyword or has a default, no launch hook is set (a profiler
such as proton sets them and wants JITFunction.run's metadata), the kernel has no pre-run hooks, and
kernels are not interpreted (TRITON_INTERPRET). Anything else goes through `kernel[grid]`.
"""
from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver

from custom_ops.triton_common import interpreting

# Distinct keys a kernel keeps before its cache is emptied: a key holds integer values such as the token
# count, so a long-running server meets new ones (one entry per capture size and batch shape seen).
MAX_ENTRIES_PER_KERNEL = 1024


class _Compiled:
    __slots__ = ("kernel", "tail")

    def __init__(self, kernel: Any, tail: tuple) -> None:
        self.kernel = kernel  # triton's CompiledKernel
        self.tail = tail      # the parameters after the positional ones, in signature order


_caches: dict[Any, dict[tuple, _Compiled]] = {}
stats = {"hits": 0, "misses": 0, "slow": 0}  # counted for tests and benchmarks


def _key(args: tuple, options: dict[str, Any], device: int) -> tuple:
    # The type with each value: True == 1 and 1.0 == 1, but they specialize differently.
    return (device, tuple(options.items()),
            *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (type(a), a) for a in args])


def _tail(kernel: Any, args: tuple, options: dict[str, Any]) -> tuple | None:
    """The values of `kernel`'s parameters after the positional `args`, in signature order, or None
    where the call does not bind that way (then the call keeps JITFunction.run)."""
    params = getattr(kernel, "params", None)
    if params is None or len(args) > len(params):
        return None
    tail = []
    for param in params[len(args):]:
        if param.name in options:
            tail.append(options[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            return None
    if any(p.name in options for p in params[:len(args)]):
        return None
    return tuple(tail)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: recent Triton keeps an empty HookChain where none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel: Any, grid: tuple[int, ...], args: tuple, options: dict[str, Any]) -> None:
    """`kernel[grid](*args, **options)`, taking the compiled launcher directly where a call of the same
    specialization was made before (module doc)."""
    if (interpreting() or getattr(kernel, "pre_run_hooks", None) or _hooked(knobs.runtime.launch_enter_hook)
            or _hooked(knobs.runtime.launch_exit_hook)):
        stats["slow"] += 1
        kernel[grid](*args, **options)
        return
    device = torch.cuda.current_device()
    cache = _caches.get(kernel)
    if cache is None:
        cache = _caches[kernel] = {}
    key = _key(args, options, device)
    entry = cache.get(key)
    if entry is None:
        stats["misses"] += 1
        compiled = kernel[grid](*args, **options)
        if hasattr(compiled, "result"):  # a future, where Triton compiles asynchronously
            compiled = compiled.result()
        tail = _tail(kernel, args, options)
        if tail is not None and compiled is not None:
            if len(cache) >= MAX_ENTRIES_PER_KERNEL:
                cache.clear()
            cache[key] = _Compiled(compiled, tail)
        return
    stats["hits"] += 1
    compiled = entry.kernel
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *entry.tail)
