"""Building models: `from_config` (random weights) and `from_pretrained` (HF-format dir or .gguf).

Checkpoint names are transformers' names. Ours are the same except for two fused matmuls, so the map
is: `...self_attn.{q,k,v}_proj.*` -> row slices of `...self_attn.qkv_proj.*`, and
`...mlp.{gate,up}_proj.*` -> row slices of `...mlp.gate_up_proj.*`. Every checkpoint tensor is
checked against the slot it fills (name and shape), and every slot must be filled exactly once.
Under tensor parallelism a slot is a shard: the loader reads only its rows or columns from the file.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from models.base import CausalLM
from models.config import ModelConfig, parse_dtype
from models.errors import MissingWeightError, ModelPathError, UnexpectedWeightError, WeightShapeError
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.parallel import SINGLE, ShardSlice, TensorParallel
from models.paths import resolve_model_path
from models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
# Checkpoint tensors that are not weights: old checkpoints saved rope tables as buffers.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(config: ModelConfig, device: torch.device | str | None = None,
                tp: TensorParallel = SINGLE) -> CausalLM:
    """The model for `config` on `device` (this rank's shards under `tp`), weights uninitialized
    (the caller fills them)."""
    with torch.device(device or "cpu"):
        return MODEL_CLASSES[config.architecture](config, tp)


def from_config(
    config: Any, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
    seed: int | None = None, tp: TensorParallel = SINGLE,
) -> CausalLM:
    """Random init from a transformers config object or a config.json dict (or a ModelConfig).
    Under `tp` each rank draws its own shards (benchmarks; not the same model as one rank's)."""
    if isinstance(config, ModelConfig):
        model_config = config if dtype is None else dataclasses.replace(config, dtype=parse_dtype(dtype))
    else:
        model_config = ModelConfig.from_hf(config, dtype)
    model = build_model(model_config, device, tp)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.model.embed_tokens.weight.device).manual_seed(seed)
    model.init_random_(generator=generator)
    return model.eval()


def from_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None, tp: TensorParallel = SINGLE, revision: str | None = None,
) -> CausalLM:
    """Load an HF-format dir (config.json + model.safetensors or a sharded index), a hub id
    ("org/name" at `revision`, through the Hugging Face cache), a .gguf file, or "default" (the real
    Gemma 3 270M, converted once to a cached dir). Under `tp` this rank reads only its shards of each
    tensor (a GGUF file is dequantized whole once, then sliced)."""
    model_dir = Path(resolve_model_path(path, revision))
    # Parsing the config fails on an unknown architecture before any weight is read.
    config = ModelConfig.from_hf(read_config(model_dir), dtype)
    eos_ids = tuple(dict.fromkeys(config.eos_token_ids + generation_eos_ids(model_dir)))
    config = dataclasses.replace(config, eos_token_ids=eos_ids)
    model = build_model(config, device, tp)
    load_weights(model, iter_checkpoint(model_dir))
    return model.eval()


def read_config(model_dir: Path) -> dict[str, Any]:
    config_path = model_dir / "config.json"
    try:
        return json.loads(config_path.read_text())
    except OSError as exc:
        raise ModelPathError(f"cannot read {config_path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ModelPathError(f"{config_path} is not valid JSON: {exc}") from exc


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, if the directory has one. Instruction-tuned checkpoints
    often list their end-of-turn token only there (Llama 3 Instruct: <|eot_id|>), so the engine stops
    on the union of these and config.json's, as transformers' generate() does."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelPathError(f"{path} is not a readable JSON object: {exc}") from exc
    values = eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelPathError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(values)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelPathError(f"cannot read shard index {index}: {exc}") from exc
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelPathError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are read)")


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy tensor) for every tensor of every shard: safetensors slices that read from the
    file only what is indexed, so a tensor-parallel rank reads just its shards and host memory stays
    bounded by one tensor."""
    from safetensors import SafetensorError, safe_open
    for file in _checkpoint_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():
                    yield name, reader.get_slice(name)
        except (OSError, SafetensorError) as exc:
            raise ModelPathError(f"cannot read checkpoint shard {file}: {exc}") from exc


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: `target` (a parameter or rows of a fused one) is filled from
    `shard` of the checkpoint tensor (all of it, unless the model is tensor-parallel)."""
    target: torch.Tensor
    shard: ShardSlice


def weight_slots(model: CausalLM) -> dict[str, Slot]:
    """Checkpoint name -> the slot it fills (fused matmuls map several checkpoint names to row
    ranges of one parameter; tensor-parallel layers name the rows or columns this rank reads)."""
    slots: dict[str, Slot] = {}
    for name, param in model.named_parameters():
        data = param.data
        module_path, _, leaf = name.rpartition(".")
        parent, _, _ = module_path.rpartition(".")
        module = model.get_submodule(module_path)
        parts = getattr(module, "parts", None)
        input_shard = getattr(module, "input_shard", None)
        if input_shard is not None and leaf == "weight":  # row-parallel: this rank's input columns
            full_in, start = input_shard
            shard = ShardSlice((data.shape[0], full_in), 1, start, start + data.shape[1])
            slots[name] = Slot(data, shard)
        elif parts is None or (leaf == "bias" and input_shard is not None):
            slots[name] = Slot(data, ShardSlice(tuple(data.shape)))
        else:
            offset = 0
            for part in parts:
                full_shape = (part.full_rows, *data.shape[1:])
                whole = part.rows == part.full_rows
                shard = ShardSlice(full_shape) if whole else ShardSlice(full_shape, 0, part.start, part.start + part.rows)
                key = name if part.name is None else f"{parent}.{part.name}.{leaf}"
                slots[key] = Slot(data[offset:offset + part.rows], shard)
                offset += part.rows
    return slots


def _shape(source: Any) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, Any]] | Mapping[str, Any]) -> None:
    """Copy checkpoint tensors into the model, cast to its dtype; every slot must be filled once.

    A tensor is a torch.Tensor or a safetensors slice; only the part the slot holds is read."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    slots = weight_slots(model)
    filled: set[str] = set()
    arch = model.config.architecture
    with torch.no_grad():
        for name, source in items:
            slot = slots.get(name)
            shape = _shape(source)
            if slot is None:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # a tied checkpoint may still carry the shared tensor; the embedding wins
                raise UnexpectedWeightError(
                    f"checkpoint weight {name!r} {shape} has no place in {arch} "
                    f"(check the config's architecture and tie_word_embeddings)")
            if name in filled:
                raise UnexpectedWeightError(
                    f"checkpoint weight {name!r} appears more than once (in two shards?); "
                    "each weight must be stored exactly once")
            if shape != slot.shard.full_shape:
                raise WeightShapeError(
                    f"checkpoint weight {name!r} has shape {shape}, "
                    f"but {arch} expects {slot.shard.full_shape} (config and checkpoint disagree)")
            slot.target.copy_(source[slot.shard.index()])
            filled.add(name)
    missing = [name for name in slots if name not in filled]
    if missing:
        shown = ", ".join(f"{n!r} {slots[n].shard.full_shape}" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingWeightError(f"checkpoint lacks {len(missing)} weight(s) {arch} needs: {shown}{more}")
