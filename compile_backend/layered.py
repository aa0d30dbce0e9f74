"""The FULL-step compile: the traced graph in one Inductor graph per decoder layer, each identical
layer compiled once.

Decode graphs record the whole forward, attention op included, so nothing forces a cut at the op;
compiling the unsplit graph as one Inductor graph lets fusions cross the op, but that graph is the
whole model: Inductor's time grows with it (most of a cold start-up) and its cache key is the whole
model's. Cutting right AFTER each attention op loses no fusion (the op writes its output buffer in
place, which any compile materializes; the next layer's first kernel is the output projection's
matmul), and the pieces between two cuts are the model's layers: embedding + layer 0 up to its
attention, then `o_proj(i-1) ... attention(i)` for every middle layer, then the tail.

Middle layers are the same graph except for the attention op's layer-name constant. Before the
compile, each piece's op calls are renamed `infer_graphs.layer.<i>` (the i-th op of the piece), so
equal layers have equal structural keys (compile_pieces.structural_key): the first layer with a key is
compiled, and every layer runs that code inside `attention_layer_renamed`, which makes the op compute
the layer it is called for. The op resolves the name when it runs in Python, which is during
capture: a decode graph records each layer's own cache, block tables and parameters. Naming no real
layer also keeps the model instance's layer prefix out of Inductor's cache key: a second engine in the
same process (a fresh model, a fresh prefix) finds the pieces in Inductor's cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from compile_backend.compile_pieces import _compile_deduplicated, _recorded_inputs
from compile_backend.split import SplitGraph, is_splitting_node, split_after
from custom_ops.attention import attention_layer_renamed


class RenamedLayer:
    """Compiled layer code run for one layer: its canonical attention calls compute that layer."""

    def __init__(self, fn: Callable[..., Any], renamed: dict[str, str]):
        self.fn = fn
        self.renamed = renamed

    def __call__(self, *args: Any) -> Any:
        with attention_layer_renamed(self.renamed):
            return self.fn(*args)


def _shallow_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module over a copy of gm's graph whose nodes share gm's meta values (the fake tensors Dynamo
    recorded, with their symbols and storages), so the split can rewrite it while gm stays as it is."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


CANONICAL_PREFIX = "infer_graphs.layer"


def _canonical_names(piece: torch.fx.GraphModule, splitting_ops: frozenset[str]) -> list[str]:
    """Replace the string constants of a piece's splitting-op calls (the attention layer names) by
    `infer_graphs.layer.<i>`, in place; the names it replaced, in order."""
    names: list[str] = []

    def canonical(value: object) -> object:
        if not isinstance(value, str):
            return value
        names.append(value)
        return f"{CANONICAL_PREFIX}.{len(names) - 1}"

    for node in piece.graph.nodes:
        if is_splitting_node(node, splitting_ops):
            node.args = tuple(canonical(a) for a in node.args)
            node.kwargs = {k: canonical(v) for k, v in node.kwargs.items()}
    if names:
        piece.recompile()
    return names


@dataclass
class LayeredCode:
    """compile_layered's result: the forward FULL steps run and what it is made of."""

    forward: Callable[..., Any]
    num_pieces: int
    num_compiles: int                                           # distinct Inductor compiles
    module: torch.fx.GraphModule                                # calls the layers in order
    layers: dict[str, tuple[Callable[..., Any], dict[str, str]]]  # piece -> (compiled code, renamed layers)
    graphs: dict[str, torch.fx.GraphModule]                     # piece -> the FX module it was compiled from


def compile_layered(gm: torch.fx.GraphModule, fake_mode: Any, splitting_ops: tuple[str, ...],
                    keep_artifacts: bool = False) -> LayeredCode:
    """The layered FULL-step code over the same inputs as gm. gm is left as it was: the split works
    on a copy. A piece whose key cannot be formed (it reads module state) is compiled on its own.
    `keep_artifacts`: compiled so it can be saved (compile_backend/artifacts.py)."""
    split = split_after(_shallow_copy(gm), splitting_ops)
    ops = frozenset(splitting_ops)
    by_key: dict[str, Callable[..., Any]] = {}  # structural key -> compiled layer (names canonical)
    compiled_layers: set[int] = set()
    layers: dict[str, tuple[Callable[..., Any], dict[str, str]]] = {}
    graphs: dict[str, torch.fx.GraphModule] = {}
    with fake_mode:
        for info in split.summary.pieces:
            piece = split.piece(info)
            args = _recorded_inputs(piece)
            if args is None:
                raise RuntimeError(f"infer_graphs: piece {info.name} of the FULL-step split has an input "
                                   "with no value recorded by the trace")
            names = _canonical_names(piece, ops)  # first: equal layers now have equal keys
            compiled = _compile_deduplicated(piece, args, by_key, keep_artifacts)
            compiled_layers.add(id(compiled))
            renamed = {f"{CANONICAL_PREFIX}.{i}": name for i, name in enumerate(names)}
            layers[info.name], graphs[info.name] = (compiled, renamed), piece
            _install(split, info.name, RenamedLayer(compiled, renamed) if renamed else compiled)
    return LayeredCode(split.module.forward, len(split.summary.pieces), len(compiled_layers), split.module, layers,
                       graphs)


def _install(split: SplitGraph, name: str, fn: Callable[..., Any]) -> None:
    # the split module calls `self.<name>(...)`: a plain attribute in the submodule's place
    delattr(split.module, name)
    split.module.__dict__[name] = fn
