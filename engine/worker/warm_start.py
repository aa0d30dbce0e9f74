"""Warm start: an engine whose compiled graph is in the cache runs it without Dynamo or Inductor.

The first start-up with a given key traces the model (Dynamo), and the backend compiles its pieces
and writes them (compile_backend/artifacts.py) into a fresh entry of the graph store,
`<compile cache>/graphs/<key>/`. A later start-up with the same key loads that entry: no trace, no
split, no compile; the engine calls the loaded graph itself with the model's parameters, as Dynamo's
compiled code would have.

The key covers everything that changes what was compiled (`key_fields`): the model's class, config,
and every parameter's and buffer's name, shape and dtype; the engine configuration (all of it but
the fields listed in NOT_IN_KEY, which only the scheduler or the KV pool read); the device; the
torch, Triton, CUDA and Python versions; the Inductor / Triton / PDL environment variables; and a
hash of this project's own source (compile_backend, custom_ops, models, engine). A different key is
a different entry: a miss says once, in the log and in `stats()["startup"]["compile_cache"]`, which
fields changed since the newest entry in the store.

What Dynamo's guards checked, the loader checks itself before the first step: every graph input is
found again (a parameter or buffer by name, with the shape, dtype, device and strides it had, the
step's input ids and positions, the token count) and the graph returns one value. Anything that
does not hold, and any entry that is missing a file, truncated or unreadable (a process killed while
writing, a disk problem) is a miss with its reason: the engine traces and compiles as on a cold
start and writes a new entry. A bad entry is removed, never half-loaded.

Entries are written into a temporary directory and renamed into place only after the whole start-up
succeeded with exactly one traced graph (a start-up that needed a second graph would be served by
one on a warm start, so it is not kept). The store keeps the MAX_ENTRIES most recently used.
INFER_GRAPHS_COMPILE_CACHE=0 turns the store off: every start-up traces and compiles (Inductor's own
caches still serve the compile), as the test suite does unless a test asks for the store.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.config import EngineConfig

logger = logging.getLogger("engine")

SWITCH_ENV = "INFER_GRAPHS_COMPILE_CACHE"  # "0": neither load nor save compiled graphs (the test suite's default)
KEY_FILE = "key.json"
MAX_ENTRIES = 8
# EngineConfig fields that change nothing compiled: scheduling, the KV pool's size, requests, the front end.
# gpu_memory_utilization sizes the KV pool; frontend_process moves detokenization to another process.
NOT_IN_KEY = frozenset({"model", "tokenizer", "seed", "show_progress", "max_waiting_requests",
                        "enable_prefix_caching", "kv_memory_fraction", "gpu_memory_utilization",
                        "num_gpu_blocks", "async_scheduling", "frontend_process"})
_SOURCE_PACKAGES = ("compile_backend", "custom_ops", "models", "engine")
# Environment variables that change generated code; cache locations do not.
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TRITON_", "INFER_GRAPHS_PDL", "INFER_GRAPHS_DEBUG_CHECKS")
_ENV_IGNORED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR",
                          "TRITON_OVERRIDE_DIR"})


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


# -- the key --------------------------------------------------------------------------------------

def _source_hash() -> str:
    """sha256 over this project's Python source (path and content of every .py file of its packages)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _package_version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def _cpu_flags() -> str:
    """The CPU's feature flags (Inductor's C++ code is built for the vector ISA they allow)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or "unknown"


def _device_fields(device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": f"cuda {props.name} sm_{props.major}{props.minor}", "cuda": str(torch.version.cuda)}
    return {"device": f"{device.type} {platform.machine()} flags {_cpu_flags()}"}


def _tensors_fields(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for kind, items in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            digest.update(f"{kind} {name} {tuple(t.shape)} {t.dtype} {t.stride()}\n".encode())
    return digest.hexdigest()


def key_fields(model: torch.nn.Module, config: EngineConfig) -> dict[str, str]:
    """Everything that changes the compiled graph, by name (what a miss reports as changed)."""
    fields = {
        "model.class": f"{type(model).__module__}.{type(model).__qualname__}",
        "model.config": repr(getattr(model, "config", None)),
        "model.tensors": _tensors_fields(model),
    }
    for f in dataclasses.fields(config):
        if f.name not in NOT_IN_KEY:
            fields[f"engine.{f.name}"] = repr(getattr(config, f.name))
    fields.update(_device_fields(torch.device(config.device)))
    fields.update({
        "torch": f"{torch.__version__} ({torch.version.git_version})",
        "triton": _package_version("triton"),
        "python": sys.version.split()[0],
        "source": _source_hash(),
        "env": repr(sorted((k, v) for k, v in os.environ.items()
                           if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED)),
    })
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        fields["rank"] = f"{torch.distributed.get_rank()} of {torch.distributed.get_world_size()}"
    return fields


def key_of(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _short(value: str, limit: int = 48) -> str:
    return value if len(value) <= limit else value[:limit - 3] + "..."


def changed_fields(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """'name: old -> new' for every field that differs."""
    return [f"{name}: {_short(old.get(name, '(none)'))} -> {_short(new.get(name, '(none)'))}"
            for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]


# -- the store ------------------------------------------------------------------------------------

class GraphStore:
    """Entries `<root>/<key>/` (key.json plus the backend's graph0/), written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def entry(self, key: str) -> Path:
        return self.root / key

    def miss_reason(self, fields: dict[str, str]) -> str:
        """Why no entry has these fields: what changed since the newest entry, or that there is none."""
        newest, newest_time = None, -1.0
        if self.root.is_dir():
            for entry in self.root.iterdir():
                key_file = entry / KEY_FILE
                if entry.name.startswith(".") or not key_file.is_file():
                    continue
                mtime = key_file.stat().st_mtime
                if mtime > newest_time:
                    newest, newest_time = key_file, mtime
        if newest is None:
            return "no entry in the cache"
        try:
            old = json.loads(newest.read_text())
        except (OSError, ValueError):
            return "no readable entry in the cache"
        changes = changed_fields(old, fields)
        return "changed " + "; ".join(changes) if changes else "no entry for this key"

    def new_entry(self) -> Path:
        path = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def commit(self, tmp: Path, fields: dict[str, str]) -> Path | None:
        """Move a complete entry into place (key.json last); None if another process got there first."""
        from compile_backend.artifacts import remove_tree
        (tmp / KEY_FILE).write_text(json.dumps(fields, indent=1, sort_keys=True))
        final = self.entry(key_of(fields))
        try:
            os.rename(tmp, final)
        except OSError:  # an entry of the same key appeared meanwhile: it is as good as ours
            remove_tree(tmp)
            return None
        self._prune()
        return final

    def touch(self, entry: Path) -> None:
        try:
            os.utime(entry / KEY_FILE)
        except OSError:
            pass

    def _prune(self) -> None:
        from compile_backend.artifacts import remove_tree
        entries = [e for e in self.root.iterdir() if not e.name.startswith(".") and (e / KEY_FILE).is_file()]
        entries.sort(key=lambda e: (e / KEY_FILE).stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            remove_tree(old)
        for tmp in self.root.glob(".tmp-*"):  # left by a killed process, an hour or more ago
            try:
                if time.time() - tmp.stat().st_mtime > 3600:
                    remove_tree(tmp)
            except OSError:
                pass


def graph_store() -> GraphStore:
    from engine.worker.compile_cache import compile_cache_dir
    return GraphStore(compile_cache_dir() / "graphs")


# -- the graph's inputs, found again without Dynamo ------------------------------------------------

class InputBinder:
    """Says what each input of the traced graph is (at the compile) and finds them again (at a load).

    Inputs are ("input", i, dtype, device type, rank): the forward's i-th argument (input ids,
    positions); ("tokens",): the token count (a symbolic size: the engine marks only the token
    dimension of its two arguments, and a graph with any other dynamic size was a second trace, which
    is never saved); ("tensor", name, shape, dtype, device type, strides): a parameter or buffer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.call_args: tuple[torch.Tensor, ...] = ()  # the forward's arguments while Dynamo traces

    def describe(self, example_inputs: Sequence[Any]) -> list[tuple]:
        by_id = {}
        for name, t in (*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)):
            by_id.setdefault(id(t), name)
        specs = []
        for index, value in enumerate(example_inputs):
            if isinstance(value, torch.SymInt):
                specs.append(("tokens",))
            elif isinstance(value, torch.Tensor):
                arg = next((i for i, a in enumerate(self.call_args) if a is value), None)
                if arg is not None:
                    specs.append(("input", arg, str(value.dtype), value.device.type, value.dim()))
                elif id(value) in by_id:
                    specs.append(("tensor", by_id[id(value)], tuple(value.shape), str(value.dtype),
                                  value.device.type, tuple(value.stride())))
                else:
                    raise ValueError(f"graph input {index} ({tuple(value.shape)} {value.dtype}) is neither an "
                                     "argument of the forward nor a parameter or buffer of the model")
            else:
                raise ValueError(f"graph input {index} is a {type(value).__name__}, which the engine cannot "
                                 "pass without Dynamo")
        return specs

    def bind(self, specs: Sequence[tuple]) -> tuple[list[Any], list[tuple], list[int]]:
        """(arguments with every parameter and buffer in place, [(slot, forward argument index, dtype,
        device type, rank)], the token count's slots); ValueError naming the first input that cannot be
        found as it was."""
        args: list[Any] = [None] * len(specs)
        inputs, tokens = [], []
        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        for slot, spec in enumerate(specs):
            if spec[0] == "input":
                _, index, dtype, device, ndim = spec
                inputs.append((slot, index, getattr(torch, dtype.removeprefix("torch.")), device, ndim))
            elif spec[0] == "tokens":
                tokens.append(slot)
            else:
                _, name, shape, dtype, device, stride = spec
                t = tensors.get(name)
                if t is None:
                    raise ValueError(f"the model has no parameter or buffer {name!r}")
                found = (tuple(t.shape), str(t.dtype), t.device.type, tuple(t.stride()))
                if found != (shape, dtype, device, stride):
                    raise ValueError(f"{name}: shape, dtype, device, strides {found}, the cached graph "
                                     f"was compiled for {(shape, dtype, device, stride)}")
                args[slot] = t
        return args, inputs, tokens


class CachedForward:
    """The loaded graph called as Dynamo's compiled code would call it: the model's parameters in
    their slots, the step's input ids and positions, the token count; its one output. The arguments'
    dtype, device and rank are checked on every call, as Dynamo's guards did (a few hundred ns)."""

    def __init__(self, graph: Any, args: list[Any], inputs: list[tuple[int, int, torch.dtype, str, int]],
                 tokens: list[int]) -> None:
        self.graph = graph
        self.args = args
        self.inputs = inputs
        self.tokens = tokens

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = list(self.args)
        call = (input_ids, positions)
        for slot, index, dtype, device, ndim in self.inputs:
            value = call[index]
            if value.dtype != dtype or value.dim() != ndim or value.device.type != device:
                names = ("input_ids", "positions")
                raise ValueError(f"the cached compiled forward takes {names[index]} as {ndim}-d {dtype} on {device}, "
                                 f"got {value.dim()}-d {value.dtype} on {value.device}")
            args[slot] = value
        for slot in self.tokens:
            args[slot] = input_ids.shape[0]
        return self.graph(*args)[0]
