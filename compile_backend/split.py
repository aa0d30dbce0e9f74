"""Split a Dynamo FX graph at the splitting ops into pieces: compute | op | compute | op | ... | compute.

Each splitting op sits alone in its piece (consecutive ones share one), so the compute pieces around
it can be compiled and captured while the op runs eagerly between them. Rules the partitioner keeps:
- original node order (`keep_original_order=True`): in-place ops must not move past their readers;
- a `getitem` stays with the node it unpacks, so no tuple crosses a piece boundary;
- a compute piece that would only allocate or reshape (an empty graph) is hoisted into the compute
  piece before it when its inputs allow, and the splitting pieces it separated merge;
- a `torch.Size` never crosses a boundary: consumers in later pieces rebuild it from its dims.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

# Targets that launch no kernel: a piece made only of these would be an empty graph.
_NO_KERNEL_FUNCTIONS = {operator.getitem, torch.empty, torch.empty_like, torch.ops.aten.sym_size.int}
_NO_KERNEL_METHODS = {"view", "size", "dim", "new_empty", "unsqueeze", "squeeze", "transpose", "permute",
                      "expand", "t"}


def op_name(target: Any) -> str | None:
    """'ns::name' for an OpOverloadPacket, 'ns::name.overload' for an OpOverload, else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    return None


def is_splitting_node(node: torch.fx.Node, splitting_ops: frozenset[str]) -> bool:
    """'ns::name' in splitting_ops matches the packet and every overload; 'ns::name.overload' matches
    that overload, and the packet (which resolves to it at run time)."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        base = target._qualified_op_name
        return base in splitting_ops or any(op.rsplit(".", 1)[0] == base for op in splitting_ops)
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        return base in splitting_ops or f"{base}.{target._overloadname}" in splitting_ops
    return False


def _display_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name = op_name(node.target)
    if name is not None:
        return name.replace("::", ".")
    return getattr(node.target, "__name__", str(node.target))


@dataclass(frozen=True)
class PieceInfo:
    index: int               # execution order
    name: str                # attribute of the split module ("submod_3")
    is_splitting: bool
    ops: tuple[str, ...]     # the piece's calls, in order
    num_inputs: int
    num_outputs: int


@dataclass(frozen=True)
class SplitSummary:
    splitting_ops: tuple[str, ...]
    pieces: tuple[PieceInfo, ...]

    @property
    def num_compute_pieces(self) -> int:
        return sum(not p.is_splitting for p in self.pieces)

    @property
    def num_splitting_pieces(self) -> int:
        return sum(p.is_splitting for p in self.pieces)

    def __str__(self) -> str:
        lines = [f"infer_graphs split: {len(self.pieces)} pieces ({self.num_compute_pieces} compute, "
                 f"{self.num_splitting_pieces} splitting) at {', '.join(self.splitting_ops) or 'nothing'}"]
        for p in self.pieces:
            kind = "split  " if p.is_splitting else "compute"
            shown = ", ".join(p.ops[:6]) + (f", ... (+{len(p.ops) - 6})" if len(p.ops) > 6 else "")
            lines.append(f"  #{p.index:<3} {p.name:<10} {kind} {len(p.ops):>4} ops  "
                         f"in {p.num_inputs:>3} out {p.num_outputs:>3}  {shown}")
        return "\n".join(lines)


@dataclass
class SplitGraph:
    module: torch.fx.GraphModule   # calls the pieces in order; its placeholders are the original ones
    summary: SplitSummary

    def piece(self, info: PieceInfo) -> torch.fx.GraphModule:
        return getattr(self.module, info.name)


def _is_shown(node: torch.fx.Node) -> bool:
    """Tensor work only: shape arithmetic and Dynamo's runtime shape asserts are noise in a summary."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_size.int):
        return False
    value = node.meta.get("example_value", node.meta.get("val"))
    return not isinstance(value, (torch.SymInt, torch.SymBool, int, bool))


def _is_no_kernel(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    if isinstance(value, (torch.SymInt, int, torch.Size)) and not isinstance(value, bool):
        return True
    if node.op == "call_method":
        return node.target in _NO_KERNEL_METHODS
    return node.op == "call_function" and node.target in _NO_KERNEL_FUNCTIONS


def _assign_partitions(graph: torch.fx.Graph, splitting_ops: tuple[str, ...]) -> tuple[dict, set[int]]:
    part: dict[torch.fx.Node, int] = {}
    splitting: set[int] = set()
    current, in_split = 0, False
    ops = frozenset(splitting_ops)
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in part:
            part[node] = part[node.args[0]]          # unpack where produced
            continue
        if is_splitting_node(node, ops):
            if not in_split:                          # consecutive splitting ops share a piece
                current += 1
                in_split = True
                splitting.add(current)
        elif in_split:
            current += 1
            in_split = False
        part[node] = current
    return part, splitting


def _hoist_empty_pieces(part: dict, splitting: set[int]) -> None:
    members: dict[int, list[torch.fx.Node]] = {}
    for node, p in part.items():
        members.setdefault(p, []).append(node)
    compute = sorted(p for p in members if p not in splitting)
    for i, p in enumerate(compute[1:], start=1):
        nodes = members[p]
        if not all(_is_no_kernel(n) for n in nodes):
            continue
        target = compute[i - 1]
        inside = set(nodes)
        if all(inp.op == "placeholder" or inp in inside or part[inp] <= target
               for n in nodes for inp in n.all_input_nodes):
            for n in nodes:
                part[n] = target
            members[target].extend(nodes)
            members[p] = []


def _renumber(graph: torch.fx.Graph, part: dict, splitting: set[int]) -> tuple[dict, set[int]]:
    """Dense ids in order of first appearance; splitting partitions left adjacent merge."""
    order: list[int] = []
    for node in graph.nodes:
        if node in part and part[node] not in order:
            order.append(part[node])
    mapping: dict[int, int] = {}
    new_splitting: set[int] = set()
    nxt = -1
    prev_split = False
    for p in order:
        is_split = p in splitting
        if not (is_split and prev_split):
            nxt += 1
        mapping[p] = nxt
        if is_split:
            new_splitting.add(nxt)
        prev_split = is_split
    return {n: mapping[p] for n, p in part.items()}, new_splitting


def _localize_sizes(graph: torch.fx.Graph, part: dict) -> None:
    """A torch.Size used in a later piece is rebuilt there from its dims (ints or SymInts, which may
    cross boundaries), since a compiled piece cannot return a torch.Size."""
    for node in list(graph.nodes):
        size = node.meta.get("example_value")
        if node not in part or not isinstance(size, torch.Size):
            continue
        far_users = [u for u in node.users if u in part and part[u] != part[node]]
        if not far_users:
            continue
        dims: list[Any] = []
        with graph.inserting_after(node):
            for i, d in enumerate(size):
                if isinstance(d, int):
                    dims.append(d)
                    continue
                g = graph.call_function(operator.getitem, (node, i))
                g.meta["example_value"] = d
                part[g] = part[node]
                dims.append(g)
        for user in far_users:
            with graph.inserting_before(user):
                rebuilt = graph.call_function(torch.Size, (list(dims),))
            rebuilt.meta["example_value"] = size
            part[rebuilt] = part[user]
            user.replace_input_with(node, rebuilt)


def split_graph(gm: torch.fx.GraphModule, splitting_ops: tuple[str, ...]) -> SplitGraph:
    part, splitting = _assign_partitions(gm.graph, splitting_ops)
    _hoist_empty_pieces(part, splitting)
    part, splitting = _renumber(gm.graph, part, splitting)
    return _split_by(gm, part, splitting, splitting_ops)


def split_after(gm: torch.fx.GraphModule, splitting_ops: tuple[str, ...]) -> SplitGraph:
    """Compute pieces only, each ending with one splitting op (the last piece: what follows the last
    op). The op's output is a buffer it writes in place, materialized in any compile, so a cut right
    after it costs no fusion: every middle layer of a model becomes one piece, op included."""
    ops = frozenset(splitting_ops)
    part: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in part:
            part[node] = part[node.args[0]]
            continue
        part[node] = current  # in node order, so the ids are already dense and ordered
        if is_splitting_node(node, ops):
            current += 1
    return _split_by(gm, part, set(), splitting_ops)


def _split_by(gm: torch.fx.GraphModule, part: dict, splitting: set[int], splitting_ops: tuple[str, ...]) -> SplitGraph:
    _localize_sizes(gm.graph, part)
    gm.recompile()
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)

    pieces = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        index = int(str(node.target).rsplit("_", 1)[1])
        ops = tuple(_display_name(n) for n in sub.graph.nodes if _is_shown(n))
        outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        num_outputs = len(outputs) if isinstance(outputs, (tuple, list)) else int(outputs is not None)
        num_inputs = sum(n.op == "placeholder" for n in sub.graph.nodes)
        pieces.append(PieceInfo(len(pieces), node.target, index in splitting, ops, num_inputs, num_outputs))
    return SplitGraph(split, SplitSummary(tuple(splitting_ops), tuple(pieces)))
