"""The FULL-step compile: the traced graph in one Inductor graph per decoder layer, each identical
layer compiled once.

Decode graphs record the whole forward, attention op included, so nothing forces a cut at the op;
compiling the unsplit graph as one Inductor graph lets fusions cross the op, but that graph is the
whole model: Inductor's time grows with it (most of a cold start-up) and its cache key is the whole
model's. Cutting right AFTER each attention op loses no fusion (the op writes its output buffer in
place, which any compile materializes; the next layer's first kernel is the output projection's
matmul), and the pieces between two cuts are the model's layers: embedding + layer 0 up to its
attention, then `o_proj(i-1) ... attention(i)` for every middle layer, then the tail.

Middle layers are the same graph except for the attention op's layer-name constant. Their
structural key (compile_pieces.structural_key) masks that name; the first layer with a key is
compiled, and every other layer with it runs that code inside `attention_layer_renamed`, which makes
the op compute the layer it is called for. The op resolves the name when it runs in Python, which is
during capture: a decode graph records each layer's own cache, block tables and parameters.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from compile_backend.compile_pieces import _compile_inductor, _recorded_inputs, structural_key
from compile_backend.split import SplitGraph, is_splitting_node, split_after
from custom_ops.attention import attention_layer_renamed


class RenamedLayer:
    """A compiled layer run for another layer: its attention calls are renamed to that layer's."""

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


def _layer_names(piece: torch.fx.GraphModule, splitting_ops: frozenset[str]) -> list[str]:
    """The string constants of a piece's splitting-op calls (the attention layer names), in order."""
    names = []
    for node in piece.graph.nodes:
        if is_splitting_node(node, splitting_ops):
            names.extend(a for a in (*node.args, *node.kwargs.values()) if isinstance(a, str))
    return names


def compile_layered(gm: torch.fx.GraphModule, fake_mode: Any, splitting_ops: tuple[str, ...],
                    ) -> tuple[Callable[..., Any], int, int]:
    """(forward over the same inputs as gm, layer pieces, distinct Inductor compiles). gm is left as it
    was: the split works on a copy. Falls back to one compile per piece where a piece's inputs have no
    recorded values (its key cannot be formed)."""
    split = split_after(_shallow_copy(gm), splitting_ops)
    ops = frozenset(splitting_ops)
    by_key: dict[str, tuple[Callable[..., Any], list[str]]] = {}
    compiles = 0
    with fake_mode:
        for info in split.summary.pieces:
            piece = split.piece(info)
            args = _recorded_inputs(piece)
            if args is None:
                raise RuntimeError(f"infer_graphs: piece {info.name} of the FULL-step split has an input "
                                   "with no value recorded by the trace")
            names = _layer_names(piece, ops)
            key = structural_key(piece, args, masked_ops=ops)
            found = by_key.get(key) if key is not None else None
            if found is None:
                fn = _compile_inductor(piece, args)
                compiles += 1
                if key is not None:
                    by_key[key] = (fn, names)
            else:
                compiled, compiled_names = found
                renamed = {a: b for a, b in zip(compiled_names, names) if a != b}
                fn = RenamedLayer(compiled, renamed) if renamed else compiled
            _install(split, info.name, fn)
    return split.module.forward, len(split.summary.pieces), compiles


def _install(split: SplitGraph, name: str, fn: Callable[..., Any]) -> None:
    # the split module calls `self.<name>(...)`: a plain attribute in the submodule's place
    delattr(split.module, name)
    split.module.__dict__[name] = fn
