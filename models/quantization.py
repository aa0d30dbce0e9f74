"""FP8 weights for the models: which linears hold them, and which FP8 checkpoints load.

`quantization="fp8"` stores the decoder's linear layers (the fused q/k/v, o, the fused gate/up and
down projections) as float8_e4m3fn with one float32 scale per output row (models.layers.Linear.to_fp8_,
custom_ops.fp8); the embedding, the LM head and the norms stay in the model dtype. Activations stay in
the model dtype too (weight-only FP8): the matmuls widen the FP8 values in registers.

Checkpoints already in FP8 (config.json's `quantization_config`) load as they are, their scales
broadcast to one per row:
- transformers' "fp8" (quant_method "fp8"): `weight` in float8_e4m3fn and `weight_scale_inv`, the
  factor that dequantizes it, per tensor (weight_block_size null) or per block (weight_block_size
  [b0, b1], the layout of DeepSeek's and Qwen3's FP8 releases: one scale per b0 x b1 tile). The kernels
  here read one scale per row, so block-wise weights are dequantized as they load and quantized again
  per row (models.loader): the values round twice, an error of the order of quantizing the original
  weights at load (tests/test_fp8.py bounds it against the block-wise weights).
- compressed-tensors' float-quantized weights (quant_method "compressed-tensors", 8-bit float weights,
  strategy "tensor" or "channel"): `weight` and `weight_scale`.
- transformers' "fbgemm_fp8" (Meta's FP8 releases): `weight` and a per-channel `weight_scale`.
Their activation scales (`input_scale`) are not read: activations are not quantized here. Any other
format, scale layout or weight type is refused with UnsupportedConfigError naming the config field.
A tensor the checkpoint keeps in bf16 for a layer that is FP8 here (an `ignore`d layer) is quantized
as it loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from models.errors import UnsupportedConfigError
from models.layers import Linear

QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How an FP8 checkpoint names its tensors."""
    method: str                                 # quantization_config.quant_method
    scale_name: str                             # the weight's scale tensor: "<layer>.<scale_name>"
    skipped: tuple[str, ...] = ("input_scale",)  # tensors not read (activation scales)
    block: tuple[int, int] | None = None        # (rows, columns) of a scale's tile; None: per tensor / row


def check_quantization(quantization: str | None, what: str = "quantization") -> str | None:
    """None or one of QUANTIZATIONS; anything else is UnsupportedConfigError naming `what`."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UnsupportedConfigError(f"{what}={quantization!r} is not supported: expected None or one of "
                                     f"{', '.join(QUANTIZATIONS)}")
    return quantization


def checkpoint_quantization(hf_config: dict[str, Any], source: str) -> Fp8Checkpoint | None:
    """The FP8 layout of a checkpoint from its config.json (`source` names it in errors), None for an
    unquantized one; any quantization_config that is not a supported FP8 layout is refused."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedConfigError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _transformers_fp8(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "fbgemm_fp8":  # per-channel weight scales; its activation bound is not used here
        return Fp8Checkpoint("fbgemm_fp8", "weight_scale", ("input_scale", "input_scale_ub"))
    raise UnsupportedConfigError(
        f"{source}: quantization_config.quant_method={method!r} is not supported: FP8 checkpoints in "
        "transformers' 'fp8' (per-tensor scales), 'fbgemm_fp8' or 'compressed-tensors' (float-quantized, "
        "per-tensor or per-channel) format load; other quantized checkpoints do not")


def _transformers_fp8(qc: dict[str, Any], source: str) -> Fp8Checkpoint:
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise UnsupportedConfigError(
            f"{source}: quantization_config.weight_block_size={block!r} is not supported: expected null (a scale "
            "per tensor) or [rows, columns] of each scale's tile, two ints >= 1")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedConfigError(f"{source}: quantization_config.activation_scheme={scheme!r} is not "
                                     "supported (expected 'dynamic' or 'static')")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedConfigError(f"{source}: quantization_config.fmt={fmt!r} is not supported: FP8 weights "
                                     "load as float8_e4m3fn ('e4m3')")
    return Fp8Checkpoint("fp8", "weight_scale_inv", block=None if block is None else (block[0], block[1]))


def _compressed_tensors(qc: dict[str, Any], source: str) -> Fp8Checkpoint:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedConfigError(
            f"{source}: quantization_config.format={fmt!r} (compressed-tensors) is not supported: only "
            "'float-quantized' FP8 weights load")
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        raise UnsupportedConfigError(f"{source}: quantization_config.kv_cache_scheme={kv!r} is not supported "
                                     "(the KV cache stays in the model dtype)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedConfigError(f"{source}: quantization_config.config_groups is missing or empty "
                                     "(compressed-tensors)")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        weights = (group or {}).get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"))
        if kind != ("float", 8):
            raise UnsupportedConfigError(
                f"{source}: {where}.weights type={kind[0]!r} num_bits={kind[1]!r} is not supported: only "
                "8-bit float (FP8) weights load")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel"):
            raise UnsupportedConfigError(
                f"{source}: {where}.weights.strategy={strategy!r} is not supported: FP8 weight scales load "
                "per tensor ('tensor') or per output channel ('channel'), not per group or block")
        if weights.get("dynamic"):
            raise UnsupportedConfigError(f"{source}: {where}.weights.dynamic=True is not supported (FP8 weights "
                                         "need their stored scales)")
        for field in ("input_activations", "output_activations"):
            act = group.get(field)
            if act is None:
                continue
            if field == "output_activations" or (act.get("type"), act.get("num_bits")) != ("float", 8):
                raise UnsupportedConfigError(
                    f"{source}: {where}.{field}={act!r} is not supported: activations run in the model dtype "
                    "(weight-only FP8), which serves FP8 input activations only")
    return Fp8Checkpoint("compressed-tensors", "weight_scale")


def fp8_linears(model: nn.Module) -> list[Linear]:
    """The linear layers FP8 applies to: every models.layers.Linear but the LM head."""
    head = getattr(model, "lm_head", None)
    return [m for m in model.modules() if isinstance(m, Linear) and m is not head]


def quantize_fp8(model: nn.Module) -> int:
    """Quantize a loaded model's decoder linears to FP8 in place (per output row; layers already FP8
    are left as they are). Call it before the model is compiled. Returns how many layers are FP8."""
    layers = fp8_linears(model)
    for layer in layers:
        layer.to_fp8_()
    return len(layers)


def fp8_layout(model: nn.Module) -> None:
    """Give the decoder linears empty FP8 weights and scales, for the loader to fill."""
    for layer in fp8_linears(model):
        layer.to_fp8_(quantize=False)
