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

from custom_ops.fp8 import FP8_DTYPE, quantize_rows
from models.base import CausalLM
from models.config import ModelConfig, parse_dtype
from models.errors import MissingWeightError, ModelPathError, UnexpectedWeightError, WeightShapeError
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.parallel import SINGLE, ShardSlice, TensorParallel
from models.paths import resolve_model_path
from models.quantization import Fp8Checkpoint, check_quantization, checkpoint_quantization, fp8_layout
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
    quantization: str | None = None,
) -> CausalLM:
    """Load an HF-format dir (config.json + model.safetensors or a sharded index), a hub id
    ("org/name" at `revision`, through the Hugging Face cache), a .gguf file, or "default" (the real
    Gemma 3 270M, converted once to a cached dir). Under `tp` this rank reads only its shards of each
    tensor (a GGUF file is dequantized whole once, then sliced).
    `quantization="fp8"`: the decoder's linears are quantized to FP8 as they load (models.quantization);
    a checkpoint already in a supported FP8 format loads as FP8 whatever `quantization` says."""
    check_quantization(quantization)
    model_dir = Path(resolve_model_path(path, revision))
    # Parsing the config fails on an unknown architecture or quantization before any weight is read.
    hf_config = read_config(model_dir)
    checkpoint = checkpoint_quantization(hf_config, str(model_dir))
    config = ModelConfig.from_hf(hf_config, dtype)
    eos_ids = tuple(dict.fromkeys(config.eos_token_ids + generation_eos_ids(model_dir)))
    config = dataclasses.replace(config, eos_token_ids=eos_ids)
    model = build_model(config, device, tp)
    if checkpoint is not None or quantization == "fp8":
        fp8_layout(model)
    load_weights(model, iter_checkpoint(model_dir), checkpoint)
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


_SCALE = "weight_scale"  # an FP8 layer's scale per row (models.layers.Linear.to_fp8_)


def _load_scale(name: str, slot: Slot, source: Any, shape: tuple[int, ...], arch: str) -> None:
    """An FP8 checkpoint's weight scale into its slot: per tensor (shape () or (1,)) broadcast to every
    row, per channel ((rows,) or (rows, 1)) row by row."""
    rows = slot.shard.full_shape[0]
    if shape in ((), (1,)):
        slot.target.fill_(float(source[...].reshape(())))
    elif shape in ((rows,), (rows, 1)):
        slot.target.copy_(source[...].reshape(rows)[slot.shard.index()])
    else:
        raise WeightShapeError(
            f"checkpoint weight scale {name!r} has shape {shape}; {arch} reads FP8 scales per tensor (() or "
            f"(1,)) or per output channel (({rows},) or ({rows}, 1)), not per block or group")


def _load_fp8_weight(name: str, slot: Slot, source: Any, scales: dict[str, Slot], filled: set[str]) -> None:
    """An FP8 slot from an FP8 checkpoint tensor (copied as is), or from a float one (quantized per row
    as it loads, its scale written to the layer's scale slot)."""
    value = source[slot.shard.index()]
    if value.dtype == FP8_DTYPE:
        slot.target.copy_(value)
        return
    if not value.is_floating_point() or value.element_size() == 1:
        raise UnexpectedWeightError(f"checkpoint weight {name!r} is {value.dtype}: FP8 weights load from "
                                    "float8_e4m3fn or from a float dtype (quantized as they load)")
    scale_name = name[:-len("weight")] + _SCALE
    if scale_name in filled:
        raise UnexpectedWeightError(f"checkpoint weight {name!r} is {value.dtype} but its scale {scale_name!r} "
                                    "was given as for an FP8 weight")
    q, scale = quantize_rows(value.to(slot.target.device))
    slot.target.copy_(q)
    scales[scale_name].target.copy_(scale)
    filled.add(scale_name)


class _BlockPairs:
    """A block-wise FP8 checkpoint's weights and tile scales, held until both of a layer have been read
    (the checkpoint may store them in any order), then dequantized and quantized per row into the slots."""

    def __init__(self, checkpoint: Fp8Checkpoint, slots: dict[str, Slot], filled: set[str]) -> None:
        self.block, self.scale_name, self.slots, self.filled = checkpoint.block, checkpoint.scale_name, slots, filled
        self.weights: dict[str, torch.Tensor] = {}  # weight name -> its shard, FP8
        self.scales: dict[str, Any] = {}  # scale name -> the checkpoint's tile scales (all of them)

    def __contains__(self, name: str) -> bool:
        return name in self.weights or name in self.scales

    def add_weight(self, name: str, value: torch.Tensor) -> None:
        self.weights[name] = value
        self._pair(name)

    def add_scale(self, name: str, source: Any) -> None:
        self.scales[name] = source
        self._pair(name[:-len(_SCALE)] + "weight")

    def _pair(self, weight_name: str) -> None:
        scale_name = weight_name[:-len("weight")] + _SCALE
        if weight_name not in self.weights or scale_name not in self.scales:
            return
        slot = self.slots[weight_name]
        scales = self.scales.pop(scale_name)[...].float()
        rows, cols = slot.shard.full_shape
        b0, b1 = self.block
        expected = (-(-rows // b0), -(-cols // b1))
        if tuple(scales.shape) != expected:
            raise WeightShapeError(f"checkpoint weight scale {self._file_name(scale_name)!r} has shape "
                                   f"{tuple(scales.shape)}; a "
                                   f"{rows} x {cols} weight in {b0} x {b1} tiles has {expected} scales")
        r0, r1 = (slot.shard.start, slot.shard.stop) if slot.shard.dim == 0 else (0, rows)
        c0, c1 = (slot.shard.start, slot.shard.stop) if slot.shard.dim == 1 else (0, cols)
        device = slot.target.device  # the arithmetic where the weight goes (a GPU's, for a large model)
        tiles = scales[r0 // b0:-(-r1 // b0), c0 // b1:-(-c1 // b1)].to(device)
        per_value = tiles.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        per_value = per_value[r0 % b0:r0 % b0 + r1 - r0, c0 % b1:c0 % b1 + c1 - c0]
        q, scale = quantize_rows(self.weights.pop(weight_name).to(device).float() * per_value)
        slot.target.copy_(q)
        self.slots[scale_name].target.copy_(scale)
        self.filled.update((weight_name, scale_name))

    def _file_name(self, scale_name: str) -> str:
        return scale_name[:-len(_SCALE)] + self.scale_name

    def check_done(self) -> None:
        for name in self.weights:
            raise MissingWeightError(f"checkpoint weight {name!r} is FP8 in {self.block[0]} x {self.block[1]} tiles "
                                     f"but its scale {self._file_name(name[:-len('weight')] + _SCALE)!r} is missing")
        for name in self.scales:
            raise UnexpectedWeightError(f"checkpoint weight scale {self._file_name(name)!r} has no FP8 weight "
                                        "beside it")


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, Any]] | Mapping[str, Any],
                 checkpoint: Fp8Checkpoint | None = None) -> None:
    """Copy checkpoint tensors into the model, cast to its dtype; every slot must be filled once.

    A tensor is a torch.Tensor or a safetensors slice; only the part the slot holds is read. FP8 layers
    (models.quantization) take FP8 tensors and their scales as `checkpoint` names them, or float tensors
    they quantize as they load."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    slots = weight_slots(model)
    filled: set[str] = set()
    arch = model.config.architecture
    blocks = _BlockPairs(checkpoint, slots, filled) if checkpoint is not None and checkpoint.block else None
    with torch.no_grad():
        for name, source in items:
            if checkpoint is not None:
                if name.endswith(tuple("." + s for s in checkpoint.skipped)):
                    continue
                if name.endswith("." + checkpoint.scale_name):
                    name = name[:-len(checkpoint.scale_name)] + _SCALE
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
            if name in filled or (blocks is not None and name in blocks):
                raise UnexpectedWeightError(
                    f"checkpoint weight {name!r} appears more than once (in two shards?); "
                    "each weight must be stored exactly once")
            if name.endswith("." + _SCALE):
                if blocks is not None:
                    blocks.add_scale(name, source)
                    continue
                _load_scale(name, slot, source, shape, arch)
                filled.add(name)
                continue
            if shape != slot.shard.full_shape:
                raise WeightShapeError(
                    f"checkpoint weight {name!r} has shape {shape}, "
                    f"but {arch} expects {slot.shard.full_shape} (config and checkpoint disagree)")
            if slot.target.dtype == FP8_DTYPE and blocks is not None:
                value = source[slot.shard.index()]
                if value.dtype == FP8_DTYPE:
                    blocks.add_weight(name, value)
                    continue
            if slot.target.dtype == FP8_DTYPE:
                _load_fp8_weight(name, slot, source, slots, filled)
            else:
                value = source[slot.shard.index()]
                if value.dtype == FP8_DTYPE:
                    raise UnexpectedWeightError(
                        f"checkpoint weight {name!r} is FP8 but {arch} keeps it in {slot.target.dtype} (the "
                        "embedding and the LM head are not FP8 here; without a quantization_config in "
                        "config.json, FP8 tensors are not read)")
                slot.target.copy_(value)
            filled.add(name)
    if blocks is not None:
        blocks.check_done()
    missing = [name for name in slots if name not in filled]
    if missing:
        shown = ", ".join(f"{n!r} {slots[n].shard.full_shape}" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingWeightError(f"checkpoint lacks {len(missing)} weight(s) {arch} needs: {shown}{more}")
