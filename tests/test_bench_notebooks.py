"""The profiling notebooks execute headless (nbclient) on the CPU with the tiny model.

CUDA-only cells print that they skip; the committed notebooks carry the outputs of a GPU run.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("graph_coverage", "capture_cost", "profile_steps")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_on_cpu(name, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("BENCH_NB_MODEL", "tiny-llama")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    nb = nbformat.read(ROOT / "bench" / "notebooks" / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if name == "graph_coverage":
        assert "hit rate" in text and "k=16" in text
    if name == "profile_steps":
        assert "decode" in text and "prefill" in text
