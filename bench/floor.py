"""Suite `floor`: the measured ceilings (copy bandwidth, bf16 matmul rate) all other floors use."""
from __future__ import annotations

from bench.measure import Ceilings, Report, measure_ceilings


def run(model: str, ceilings: Ceilings | None = None, **_: object) -> Report:
    ceilings = ceilings or measure_ceilings()
    report = Report("floor", model, ceilings.device_name, ["ceiling", "measured", "unit"])
    report.add(ceiling="device copy bandwidth (read + write)", measured=ceilings.copy_bytes_per_s / 1e12, unit="TB/s")
    report.add(ceiling="bf16 matmul 8192^3", measured=ceilings.matmul_flops_per_s / 1e12, unit="TFLOP/s")
    return report
