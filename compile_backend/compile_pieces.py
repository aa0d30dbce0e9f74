"""Compile the compute pieces once for the symbolic token count; make the splitting pieces thin.

Compute pieces: the split module runs once under the fake mode of the Dynamo trace, so every piece
sees fake inputs with the symbolic token dimension, and each compute piece is compiled for exactly
those (Inductor's `compile_fx`, or the FX piece itself for "eager").

Identical compute pieces (every middle layer of a model is one) are compiled once: a piece's
structural key (its nodes with placeholders numbered, constants, its inputs' fake shapes, strides
and dtypes, and which of its inputs share storage) maps to one compiled callable. Weights are graph
inputs, so one callable serves every layer; Inductor's own caches would find the same artifact, but
only after tracing and hashing each piece again (~0.2 s per piece on an H100 host).

Splitting pieces: an op called through the dispatcher costs ~20 us (TOOLCHAIN), once per layer per
step, on the host path between two graph replays. A piece that only calls known ops is replaced by
direct Python calls of their implementations (the custom op exists for tracing).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

from compile_backend.split import SplitGraph, op_name


def _direct_impls() -> dict[str, Callable[..., Any]]:
    from custom_ops.attention import run_attention   # downward import; the op's own implementation
    return {"infer::attention": run_attention}


class DirectCalls:
    """Calls a splitting piece's ops directly, in order; the piece returns nothing (ops mutate)."""

    def __init__(self, calls: list[tuple[Callable[..., Any], list[Any], list[tuple[int, int]], dict[str, Any]]]):
        self.calls = calls  # (fn, arg template, [(template slot, piece input index)], kwargs)

    def __call__(self, *args: Any) -> None:
        for fn, template, slots, kwargs in self.calls:
            values = list(template)
            for slot, index in slots:
                values[slot] = args[index]
            fn(*values, **kwargs)


def _holds_node(value: Any) -> bool:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return bool(found)


def splitting_runner(piece: torch.fx.GraphModule) -> Callable[..., Any]:
    """DirectCalls when every node is a known op with placeholder/constant args and the piece
    returns nothing; otherwise the piece's own forward (still correct, just dispatcher-priced)."""
    impls = _direct_impls()
    inputs: dict[torch.fx.Node, int] = {}
    calls = []
    for node in piece.graph.nodes:
        if node.op == "placeholder":
            inputs[node] = len(inputs)
        elif node.op == "output":
            if node.args[0] not in (None, (), []):
                return piece.forward
        elif node.op == "call_function" and (name := op_name(node.target)) is not None and not node.users:
            if _holds_node(node.kwargs):
                return piece.forward
            base = name if isinstance(node.target, torch._ops.OpOverloadPacket) else name.rsplit(".", 1)[0]
            fn = impls.get(base)
            if fn is None:   # unknown op: skip the packet's overload resolution at least
                fn = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) else node.target
            template, slots = [], []
            for slot, arg in enumerate(node.args):
                if isinstance(arg, torch.fx.Node):
                    if arg not in inputs:
                        return piece.forward
                    slots.append((slot, inputs[arg]))
                    template.append(None)
                elif _holds_node(arg):  # a list of tensors: the template cannot hold the values
                    return piece.forward
                else:
                    template.append(arg)
            calls.append((fn, template, slots, dict(node.kwargs)))
        else:
            return piece.forward
    return DirectCalls(calls)


# Ops that pay off only inside a graph that records them, with the plain op that computes the same:
def _private_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module over a copy of gm's graph (attributes shared): what a compiler or the split may rewrite
    while gm stays what its callers run."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


# Inductor's own cudagraphs stay off: this backend captures per token count itself. Kernels are tuned
# when first run, as compile_fx does by default (standalone_compile would tune at compile time, at the
# unbacked token count's fallback size).
_INDUCTOR_PATCHES = {"triton.cudagraphs": False}
_ARTIFACT_PATCHES = {**_INDUCTOR_PATCHES, "triton.autotune_at_compile_time": False}


def _compile_inductor(piece: torch.fx.GraphModule, fake_args: Sequence[Any],
                      keep_artifact: bool = False) -> Callable[..., Any]:
    """Inductor's code for the piece. `keep_artifact`: through `torch._inductor.standalone_compile`,
    whose result can also be saved and loaded in another process (compile_backend/artifacts.py); it
    compiles the same way, inside the trace's own shape environment."""
    # Inductor rewrites the module it compiles (one with a single output comes to return a 1-tuple):
    # it gets a copy, and the piece stays what its caller runs.
    if keep_artifact:
        from torch._inductor import standalone_compile
        return standalone_compile(_private_copy(piece), list(fake_args), dynamic_shapes="from_tracing_context",
                                  options={"config_patches": dict(_ARTIFACT_PATCHES)})
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(_private_copy(piece), list(fake_args), config_patches=dict(_INDUCTOR_PATCHES))


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or target}"


def _input_key(value: Any, storages: dict[Any, int]) -> str | None:
    if isinstance(value, torch.Tensor):
        # which earlier input (if any) shares this one's storage: code compiled for aliased inputs
        # (a mutation seen through a view) is not code for separate ones, and the reverse
        try:
            storage = storages.setdefault(StorageWeakRef(value.untyped_storage()), len(storages))
        except (RuntimeError, NotImplementedError):  # no storage to compare (a wrapper subclass)
            return None
        return (f"T{tuple(value.shape)}{tuple(value.stride())}+{value.storage_offset()}|{value.dtype}|"
                f"{value.device}|{value.requires_grad}@{storage}")
    return f"{type(value).__name__}:{value}"


def structural_key(piece: torch.fx.GraphModule, args: Sequence[Any]) -> str | None:
    """Equal keys mean one compiled callable computes both pieces; None: the piece reads module state
    (get_attr, call_module), which a shared callable could not see, or an input has no storage to
    compare, so it is compiled on its own."""
    numbers: dict[torch.fx.Node, str] = {}
    parts = []
    for node in piece.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            return None
        numbers[node] = f"%{len(numbers)}"
        target = "" if node.op == "placeholder" else _target_name(node.target)
        operands = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: numbers[n])
        parts.append(f"{node.op} {target} {operands!r}")
    storages: dict[Any, int] = {}
    inputs = [_input_key(a, storages) for a in args]
    if None in inputs:
        return None
    return "\n".join(parts + inputs)


def _compile_deduplicated(piece: torch.fx.GraphModule, args: Sequence[Any],
                          by_key: dict[str, Callable[..., Any]], keep_artifacts: bool = False) -> Callable[..., Any]:
    key = structural_key(piece, args)
    compiled = by_key.get(key) if key is not None else None
    if compiled is None:
        compiled = _compile_inductor(piece, args, keep_artifacts)
        if key is not None:
            by_key[key] = compiled
    return compiled


def _recorded_inputs(piece: torch.fx.GraphModule) -> list[Any] | None:
    """The fake values Dynamo recorded for a piece's inputs (split_module copies each input node's
    meta onto the piece's placeholder, in call order), or None if one is missing. The same graph
    value is the same fake tensor in every piece that reads it, and views share its fake storage, so
    structural keys see the aliasing that fake propagation would have produced."""
    values = []
    for node in piece.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val", node.meta.get("example_value"))
        if value is None:
            return None
        values.append(value)
    return values


class _PieceCompiler(torch.fx.Interpreter):
    """Propagates fake values through the split module, compiling each compute piece with Inductor on
    its way (the fallback for pieces whose input values the trace did not record)."""

    def __init__(self, split: SplitGraph, keep_artifacts: bool = False):
        super().__init__(split.module)
        self.keep_artifacts = keep_artifacts
        self.compute = {p.name for p in split.summary.pieces if not p.is_splitting}
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.by_key: dict[str, Callable[..., Any]] = {}   # structural key -> compiled callable

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        piece = self.fetch_attr(target)
        if target in self.compute:
            self.compiled[target] = (_compile_deduplicated(piece, args, self.by_key, self.keep_artifacts)
                                     if not kwargs else _compile_inductor(piece, args, self.keep_artifacts))
        return piece(*args, **kwargs)


def graph_fake_inputs(example_inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """(fake mode, fake inputs) for the pieces: Dynamo hands the backend real tensors and a fresh fake
    mode over the trace's shape env; `from_tensor` finds each input's symbolic context (the marked
    token dim) in the tracing context, so the fakes carry the same symbols as the graph."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("infer_graphs: no fake mode for the traced graph; call the backend through "
                           "torch.compile")
    return fake_mode, [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


def compile_pieces(split: SplitGraph, fake_mode: Any, fake_inputs: Sequence[Any],
                   compiler: str, keep_artifacts: bool = False) -> tuple[dict[str, Callable[..., Any]], int]:
    """(name -> callable for every piece: compiled compute pieces and direct-call splitting pieces,
    number of distinct compilations). `keep_artifacts`: Inductor pieces that can be saved
    (compile_backend/artifacts.py)."""
    compute = [info for info in split.summary.pieces if not info.is_splitting]
    if compiler != "inductor":
        compiled = {info.name: split.piece(info).forward for info in compute}
    else:
        recorded = [_recorded_inputs(split.piece(info)) for info in compute]
        if all(args is not None for args in recorded):
            # Each piece compiles from the values the trace recorded for its inputs: running the whole
            # split module on fake tensors to find them costs about as much as the warm-cache compile.
            by_key: dict[str, Callable[..., Any]] = {}
            with fake_mode:
                compiled = {info.name: _compile_deduplicated(split.piece(info), args, by_key, keep_artifacts)
                            for info, args in zip(compute, recorded)}
        else:
            interpreter = _PieceCompiler(split, keep_artifacts)
            with fake_mode:
                interpreter.run(*fake_inputs)
            compiled = interpreter.compiled
    runners = dict(compiled)
    for info in split.summary.pieces:
        if info.is_splitting:
            runners[info.name] = splitting_runner(split.piece(info))
    distinct = len({id(fn) for fn in compiled.values()}) if compiler == "inductor" else 0
    return runners, distinct
