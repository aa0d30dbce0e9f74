"""A bounded, graph-safe scratch buffer for Triton kernels that split their reduction (split-K)."""
from __future__ import annotations

import torch


class Workspace:
    """One scratch buffer (per device, per use) sliced per launch: split-K partials (float32), or
    arrival counters (int32, zeroed: every launch that uses them leaves them at 0).

    Sized at first use to a bound the caller gives (the largest need its automatic choices can
    produce: for decode attention, rows <= 4 * SMs * group, about 1-2 MiB), and grown only when a
    launch needs more (an explicit split count, a wider model). Bounded, unlike a buffer per shape.
    A graph records the buffer's address, so a buffer that a capture used is kept alive when a
    larger one replaces it; a launch inside a capture never grows it (it takes a temporary from the
    graph's own pool instead, which the captured graph owns; a zeroed temporary is zeroed by a memset
    the graph records, so every replay starts from zeros).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, zeroed: bool = False) -> None:
        self.dtype = dtype
        self.zeroed = zeroed
        self.buffer: torch.Tensor | None = None
        self.captured = False               # the current buffer is recorded in some graph
        self.retired: list[torch.Tensor] = []  # older buffers that graphs still read

    def _new(self, numel: int, device: torch.device) -> torch.Tensor:
        return (torch.zeros if self.zeroed else torch.empty)(numel, dtype=self.dtype, device=device)

    def take(self, num_elements: int, bound_elements: int, device: torch.device) -> torch.Tensor:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.buffer is None or self.buffer.numel() < num_elements:
            if capturing:
                return self._new(num_elements, device)
            if self.buffer is not None and self.captured:
                self.retired.append(self.buffer)
            self.buffer = self._new(max(num_elements, bound_elements), device)
            self.captured = False
        self.captured |= capturing
        return self.buffer[:num_elements]
