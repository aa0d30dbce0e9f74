"""When a kernel of this project, or of Inductor's code for it, uses programmatic dependent launch.

Under PDL (Hopper and newer) a kernel may be scheduled while the kernel before it is still finishing; it
waits in-kernel (`gdc_wait`) before it reads anything that kernel wrote or writes anything at all, and
does its independent work (loading its own weights, say) before the wait. A decode step is hundreds of
small kernels, and that overlap is much of what separates them (on an H100 it takes 8-14% off a
batch-1 decode graph's replay; docs/performance.md).

No Triton import here: the compile backend asks too.
"""
from __future__ import annotations

import os

import torch

PDL_ENV = "INFER_GRAPHS_PDL"
_by_device: dict[int, bool] = {}


def pdl_wanted() -> bool:
    """On unless INFER_GRAPHS_PDL=0 (to measure it, or to rule it out)."""
    return os.environ.get(PDL_ENV, "1") != "0"


def launch_with_pdl(device: torch.device) -> bool:
    """Whether a kernel launched on `device` uses PDL: compiled (not the interpreter) for a Hopper or
    newer GPU (the griddepcontrol instructions are sm_90+), and wanted. Decided at the first launch on
    each device and kept: a launcher runs per layer between piecewise graphs, where two environment
    reads per call would be host time the GPU waits for."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    decided = _by_device.get(index)
    if decided is None:
        from custom_ops.triton_common import interpreting
        decided = (not interpreting() and pdl_wanted()
                   and torch.cuda.get_device_capability(index)[0] >= 9)
        _by_device[index] = decided
    return decided


def pdl_launch_options(enabled: bool) -> dict:
    """The launch keyword a PDL launch adds (none otherwise: the interpreter takes no launch_pdl)."""
    return {"launch_pdl": True} if enabled else {}
