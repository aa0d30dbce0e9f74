"""What one compiled graph is made of, written to a directory and read back without Dynamo or Inductor.

A compiled graph is the split module (its top-level code calls the pieces in order), the compiled
compute pieces and the splitting pieces (their FX code: the direct calls are rebuilt from it).
`save_graph` writes them; `load_graph` returns the
same parts, ready for a CompiledGraph, in milliseconds per piece: no trace, no split, no compile.

Files of one graph directory:
  graph.pkl     the split module pickled with stub modules in the compute pieces' places (an FX
                GraphModule pickles as its code, re-read by FX on load), the split summary, each
                compute piece's input names and artifact;
  a<i>.bin      one Inductor artifact per DISTINCT compiled piece (torch._inductor.standalone_compile's
                CompiledArtifact, binary format: the FX-graph / AOTAutograd cache entries and their
                Triton kernels), or a<i>.pkl, a piece compiled with "eager" (its FX module).
  manifest.json every file's size and sha256: a truncated or corrupted file is refused by name, never
                half-loaded.
Identical pieces (every middle layer) share one artifact, as they share one compiled callable.

Nothing here decides WHEN a graph may be reused: the caller keys the directory by everything that
changes the artifacts (engine/worker/warm_start.py) and checks the inputs it passes, which Dynamo's
guards would otherwise have checked. Every failure to read raises ArtifactError naming the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx

from compile_backend.split import SplitGraph, SplitSummary

FORMAT = 2  # 2: no FULL-step code of its own (the layered / unsplit compiles are gone)
GRAPH_FILE = "graph.pkl"
MANIFEST_FILE = "manifest.json"


class ArtifactError(RuntimeError):
    """A graph directory that cannot be used: missing, truncated, corrupted, or from another format."""


class _Stub(torch.nn.Module):
    """Holds a compute piece's place in the pickled split module; the loader installs the artifact."""


@dataclass
class LoadedGraph:
    split: SplitGraph
    runners: dict[str, Callable[..., Any]]      # every piece: compute artifacts and splitting runners
    piece_inputs: dict[str, tuple[str, ...]]   # compute piece -> its placeholder names
    meta: dict[str, Any] = field(default_factory=dict)  # the saver's own (input names, step inputs, ...)


def keeps_artifact(fn: Any) -> bool:
    """Whether a compiled piece can be written: an Inductor CompiledArtifact, or an FX module's forward."""
    return callable(getattr(fn, "save", None)) or isinstance(getattr(fn, "__self__", None), torch.fx.GraphModule)


class _Writer:
    """One file per distinct compiled callable."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.names: dict[int, str] = {}
        self.single_output: set[str] = set()  # artifacts of modules that return one value, not a tuple

    def add(self, fn: Any, module: torch.fx.GraphModule | None = None) -> str:
        """`module`: the FX module `fn` was compiled from (whether it returns a tuple)."""
        name = self.names.get(id(fn))
        if name is not None:
            return name
        index = len(self.names)
        if callable(getattr(fn, "save", None)):
            name = f"a{index}.bin"
            fn.save(path=str(self.directory / name), format="binary")
            if module is not None and not _returns_tuple(module):
                self.single_output.add(name)
        elif isinstance(getattr(fn, "__self__", None), torch.fx.GraphModule):
            name = f"a{index}.pkl"
            (self.directory / name).write_bytes(pickle.dumps(fn.__self__))
        else:
            raise ArtifactError(f"a compiled piece of type {type(fn).__name__} cannot be saved")
        self.names[id(fn)] = name
        return name


def _returns_tuple(module: torch.fx.GraphModule) -> bool:
    output = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


class _FirstOutput:
    """A loaded Inductor artifact returns its outputs as a sequence; the compile it came from returned
    a module's single value as itself (compile_fx unwraps it), and so does this."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)[0]


def _picklable_top(module: torch.fx.GraphModule, compute: set[str]) -> torch.fx.GraphModule:
    """A copy of the split module whose compute pieces are stubs (their code lives in the artifacts)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    root = {}
    for node in module.graph.nodes:
        if node.op == "call_module":
            root[node.target] = _Stub() if node.target in compute else getattr(module, node.target)
    return torch.fx.GraphModule(root, graph)


def save_graph(directory: Path, split: SplitGraph, runners: dict[str, Callable[..., Any]],
               meta: dict[str, Any]) -> None:
    """Write one compiled graph into `directory` (which must exist and be empty). Call before
    CompiledGraph takes the split module over (it replaces the submodules by runners).

    `meta`: picklable facts the caller wants back (input names, step inputs)."""
    writer = _Writer(directory)
    compute = {p.name for p in split.summary.pieces if not p.is_splitting}
    pieces = {info.name: writer.add(runners[info.name], split.piece(info))
              for info in split.summary.pieces if info.name in compute}
    piece_inputs = {name: tuple(n.name for n in split.piece(info).graph.nodes if n.op == "placeholder")
                    for info in split.summary.pieces if (name := info.name) in compute}
    record = {"format": FORMAT, "torch": torch.__version__, "module": _picklable_top(split.module, compute),
              "summary": split.summary, "pieces": pieces, "piece_inputs": piece_inputs,
              "single_output": sorted(writer.single_output), "meta": meta}
    (directory / GRAPH_FILE).write_bytes(pickle.dumps(record))
    files = sorted(p.name for p in directory.iterdir())
    manifest = {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
                for name in files}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_files(directory: Path) -> dict[str, dict]:
    """The manifest, after checking every file it names has its size and hash; ArtifactError otherwise."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: unreadable ({exc})") from None
    for name, expected in manifest.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            raise ArtifactError(f"{path}: missing") from None
        if size != expected["bytes"]:
            raise ArtifactError(f"{path}: {size} bytes, the manifest says {expected['bytes']} (truncated?)")
        if _sha256(path) != expected["sha256"]:
            raise ArtifactError(f"{path}: content differs from the manifest's hash (corrupted)")
    return manifest


def _load_artifact(directory: Path, name: str, cache: dict[str, Any], single_output: set[str]) -> Any:
    fn = cache.get(name)
    if fn is not None:
        return fn
    path = directory / name
    try:
        if name.endswith(".bin"):
            from torch._inductor import CompiledArtifact
            fn = CompiledArtifact.load(path=str(path), format="binary")
            if name in single_output:
                fn = _FirstOutput(fn)
        else:
            fn = pickle.loads(path.read_bytes()).forward
    except Exception as exc:  # noqa: BLE001 - any failure to read an artifact is a cache miss, named
        raise ArtifactError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})") from None
    cache[name] = fn
    return fn


def _rename_constants(piece: torch.fx.GraphModule, rename: dict[str, str]) -> None:
    """Replace string arguments (layer names) of a piece's calls, in place."""
    changed = False
    for node in piece.graph.nodes:
        if node.op == "call_function":
            args = tuple(rename.get(a, a) if isinstance(a, str) else a for a in node.args)
            kwargs = {k: rename.get(v, v) if isinstance(v, str) else v for k, v in node.kwargs.items()}
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        piece.recompile()


def load_graph(directory: Path, layer_names: Any = None) -> LoadedGraph:
    """The parts save_graph wrote, loaded; ArtifactError names what could not be used.

    `layer_names`: the string arguments of the splitting ops in graph order (the attention layers'
    names) as the caller's model has them, when they may differ from the saved graph's
    (meta["layer_names"]; a model instance's layer prefix is its own): every piece then names the
    caller's layers."""
    from compile_backend.compile_pieces import splitting_runner

    verify_files(directory)
    try:
        record = pickle.loads((directory / GRAPH_FILE).read_bytes())
    except Exception as exc:  # noqa: BLE001
        raise ArtifactError(f"{directory / GRAPH_FILE}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ArtifactError(f"{directory / GRAPH_FILE}: format {record.get('format') if isinstance(record, dict) else '?'}, "
                            f"this code reads {FORMAT}")
    rename: dict[str, str] = {}
    if layer_names is not None:
        saved = list(record["meta"].get("layer_names", ()))
        if len(saved) != len(layer_names):
            raise ArtifactError(f"{directory}: the graph calls {len(saved)} layers, the model has {len(layer_names)}")
        rename = {old: new for old, new in zip(saved, layer_names) if old != new}
    summary: SplitSummary = record["summary"]
    split = SplitGraph(record["module"], summary)
    loaded: dict[str, Any] = {}
    single = set(record["single_output"])
    runners = {name: _load_artifact(directory, file, loaded, single) for name, file in record["pieces"].items()}
    for info in summary.pieces:
        if info.is_splitting:
            if rename:
                _rename_constants(split.piece(info), rename)
            runners[info.name] = splitting_runner(split.piece(info))
    return LoadedGraph(split, runners, record["piece_inputs"], record["meta"])


def remove_tree(path: Path) -> None:
    """Best effort: a directory another process may be reading or removing too."""
    import shutil
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():  # pragma: no cover - e.g. a permission problem: leave it, the caller re-creates elsewhere
        os.replace(path, path.with_name(path.name + f".stale-{os.getpid()}"))


@dataclass
class ArtifactSink:
    """Where a backend writes every graph it compiles (`graph<i>/` under `directory`), and how it went.
    `describe_inputs(example_inputs)`: the caller's picklable account of the graph's inputs (how to find
    each one again without Dynamo), saved with the graph."""

    directory: Path
    describe_inputs: Callable[[Any], Any] | None = None
    saved: int = 0
    failure: str | None = None
