"""Execute a notebook's code cells in this process and save their outputs into it (no Jupyter needed).

    python bench/notebooks/execute.py NOTEBOOK.ipynb [OUT.ipynb]

For machines without nbclient/ipykernel (the GPU image): cells run in order in one namespace,
stdout/stderr become stream outputs, matplotlib figures open at a cell's end become PNG outputs.
CI executes the same notebooks with nbclient (tests/test_bench_notebooks.py).
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import sys
import traceback


def _figures() -> list[dict]:
    if "matplotlib.pyplot" not in sys.modules:
        return []
    import matplotlib.pyplot as plt
    outputs = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=90, bbox_inches="tight")
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": ["<Figure>"]}})
    plt.close("all")
    return outputs


def execute(path: str, out_path: str | None = None) -> bool:
    os.environ.setdefault("MPLBACKEND", "Agg")
    with open(path) as f:
        nb = json.load(f)
    namespace: dict = {"__name__": "__main__"}
    count = 0
    ok = True
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        stdout, stderr = io.StringIO(), io.StringIO()
        outputs = []
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                exec(compile(source, f"<cell {count}>", "exec"), namespace)
        except Exception as exc:  # record it like Jupyter does, and stop: later cells depend on this one
            ok = False
            outputs.append({"output_type": "error", "ename": type(exc).__name__, "evalue": str(exc),
                            "traceback": traceback.format_exc().splitlines()})
        for name, buf in (("stdout", stdout), ("stderr", stderr)):
            if buf.getvalue():
                outputs.insert(0 if name == "stdout" else len(outputs),
                               {"output_type": "stream", "name": name, "text": buf.getvalue()})
        outputs += _figures()
        cell["outputs"] = outputs
        cell["execution_count"] = count
        if not ok:
            break
    with open(out_path or path, "w") as f:
        json.dump(nb, f, indent=1)
        f.write("\n")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if execute(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None) else 1)
