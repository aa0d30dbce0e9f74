"""`launch(kernel, grid, args, options)`: a @triton.jit kernel launched again at a quarter of the host
cost of `kernel[grid](*args, **options)`.

Between two piecewise graphs the attention op's kernel launch is host time the GPU waits for: with
triton 3.6, ~49 us a launch through `kernel[grid](...)`, of which the compiled launcher
(`CompiledKernel.run`) is ~11 us (llama-3.2-3b's 28 prefill launches: 1.38 ms of a 64-token step). The rest is
JITFunction.run deriving again, on every call, the specialization it compiled for (each argument's
type, each pointer's 16-byte alignment, each integer's divisibility by 16 and equality to 1) and
looking it up.

Here each kernel keeps its compiled variants under a key that fixes that specialization, and no
more: each integer's class (equal to 1, divisible by 16, the integer type its range needs), each
tensor's dtype and 16-byte alignment, a float's or a bool's type (Triton passes them as fp32 / i1
whatever the value), any other argument's value, the keyword arguments (constexprs and launch
options, which a call site passes in one order) and the device; for a do_not_specialize parameter,
an integer's type only, and for a do_not_specialize_on_alignment one, a tensor's dtype only, as Triton. Integer values stay out of the key: the token count and the
stored-row count change from step to step in serving, and a key per value missed on every new count
(a plain launch and a new entry each time). A miss goes through `kernel[grid](...)`, which compiles
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

# Distinct keys a kernel keeps before its cache is emptied: a bound for call sites that pass values which
# do enter the key (a float's or an int's class does not grow; other objects might).
MAX_ENTRIES_PER_KERNEL = 1024


class _Compiled:
    __slots__ = ("kernel", "tail")

    def __init__(self, kernel: Any, tail: tuple) -> None:
        self.kernel = kernel  # triton's CompiledKernel
        self.tail = tail      # the parameters after the positional ones, in signature order


class _KernelCache:
    __slots__ = ("entries", "unspecialized", "unaligned")

    def __init__(self, kernel: Any) -> None:
        self.entries: dict[tuple, _Compiled] = {}
        # read once per kernel: its parameters are fixed
        self.unspecialized = _flagged(kernel, "do_not_specialize")
        self.unaligned = _flagged(kernel, "do_not_specialize_on_alignment")


_caches: dict[Any, _KernelCache] = {}
stats = {"hits": 0, "misses": 0, "slow": 0}  # counted for tests and benchmarks


def _wide_int_type(a: int) -> str:
    """Triton's type for an integer outside i32's range."""
    return "u64" if a >= 9223372036854775808 else "i64"


def _arg_key(a: Any) -> Any:
    cls = a.__class__
    if cls is int:
        # Triton's classes: 1 (a constant), divisible by 16 (an alignment hint), i32 / i64 / u64 by range.
        # Strings, not bools: True == 1 would make "divisible" and "one" one key.
        if -2147483648 <= a <= 2147483647:
            return "one" if a == 1 else ("d16" if not a & 15 else "i32")
        return _wide_int_type(a), not a & 15
    if cls is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, not a.data_ptr() & 15
    if cls is float or cls is bool:
        return cls  # passed as fp32 / i1: the value never specializes
    return cls, a   # anything else (None, a dtype): its value, as the plain path would see it


def _int_type(a: Any) -> Any:
    """A do_not_specialize parameter's key: an integer's type only (Triton's i32 / i64 / u64 by range)."""
    if a.__class__ is not int:
        return _arg_key(a)
    return "i32" if -2147483648 <= a <= 2147483647 else _wide_int_type(a)


def _flagged(kernel: Any, flag: str) -> tuple[int, ...]:
    """Indices of `kernel`'s parameters with `flag` set: do_not_specialize (Triton does not split their
    values by class) or do_not_specialize_on_alignment (nor their pointers by 16-byte alignment)."""
    params = getattr(kernel, "params", None) or ()
    return tuple(i for i, p in enumerate(params) if getattr(p, flag, False))


def _key(args: tuple, options: dict[str, Any], device: int, unspecialized: tuple[int, ...] = (),
         unaligned: tuple[int, ...] = ()) -> tuple:
    key = [device, tuple(options.items()), *map(_arg_key, args)]
    for i in unspecialized:
        if i < len(args):
            key[i + 2] = _int_type(args[i])
    for i in unaligned:
        if i < len(args) and isinstance(args[i], torch.Tensor):
            key[i + 2] = args[i].dtype
    return tuple(key)


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
    # A constexpr bound positionally would need its value in the key, which keys integers by class.
    if any(p.name in options or getattr(p, "is_constexpr", True) for p in params[:len(args)]):
        return None
    return tuple(tail)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: recent Triton keeps an empty HookChain where none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


def fast_path_open(kernel: Any) -> bool:
    """Whether `launch` may call a compiled variant of kernel directly now (module doc: no interpreter,
    no pre-run or launch hooks)."""
    return not (interpreting() or getattr(kernel, "pre_run_hooks", None)
                or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook))


def variant(kernel: Any, args: tuple, options: dict[str, Any]) -> _Compiled | None:
    """The compiled variant a call `launch(kernel, grid, args, options)` made before would take now, or
    None. A caller that keeps it and later calls `run_variant` with arguments of the same
    specialization (every integer of the same class, every tensor of the same dtype and 16-byte
    alignment, the same options) skips the key; that sameness is the caller's to keep."""
    cache = _caches.get(kernel)
    if cache is None:
        return None
    return cache.entries.get(_key(args, options, torch.cuda.current_device(), cache.unspecialized, cache.unaligned))


def run_variant(entry: _Compiled, grid: tuple[int, int, int], args: tuple | list) -> None:
    """Launch a variant from `variant` with `args` (the positional arguments) over a 3-axis grid."""
    stats["hits"] += 1
    compiled = entry.kernel
    compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(torch.cuda.current_device()),
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *entry.tail)


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
        cache = _caches[kernel] = _KernelCache(kernel)
    key = _key(args, options, device, cache.unspecialized, cache.unaligned)
    entry = cache.entries.get(key)
    if entry is None:
        stats["misses"] += 1
        compiled = kernel[grid](*args, **options)
        if hasattr(compiled, "result"):  # a future, where Triton compiles asynchronously
            compiled = compiled.result()
        tail = _tail(kernel, args, options)
        if tail is not None and compiled is not None:
            if len(cache.entries) >= MAX_ENTRIES_PER_KERNEL:
                cache.entries.clear()
            cache.entries[key] = _Compiled(compiled, tail)
        return
    stats["hits"] += 1
    compiled = entry.kernel
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *entry.tail)
