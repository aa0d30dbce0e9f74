"""What every GPU suite does first: the device, the model with random weights, the ceilings."""
from __future__ import annotations

import gc
import time

import torch

from bench.configs import load_config


def device_and_dtype() -> tuple[str, torch.dtype]:
    """bf16 on CUDA (what the floors assume); float32 on CPU, where suites only smoke-test."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def build_model(name_or_dir: str, seed: int = 0):
    """Our model for a benchmark name or model dir: random weights from the config (they time like real ones)."""
    import models
    device, dtype = device_and_dtype()
    return models.from_config(load_config(name_or_dir), dtype=dtype, device=device, seed=seed)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Deadline:
    """A wall-clock budget for optional work (peers): skipped rows say so in the report's notes."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds


def parse_ints(value: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None or value == "":
        return default
    if isinstance(value, (tuple, list)):
        return tuple(int(v) for v in value)
    return tuple(int(v) for v in str(value).split(",") if v.strip())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
