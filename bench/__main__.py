"""`python -m bench SUITE --model NAME_OR_DIR [--out DIR]`: run one benchmark suite, write JSON + Markdown."""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys

SUITES = ("floor", "decode", "prefill", "capture", "serving")


def default_out_dir() -> str:
    import torch
    gpu = torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else "cpu"
    gpu = "".join(c for c in gpu if c.isalnum() or c == "-")
    return os.path.join("bench", "results", f"{gpu}-{datetime.date.today().isoformat()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--model", default="llama-3.2-3b",
                        help="llama-3.2-3b, qwen3-4b, gemma-3-1b (real configs, random weights) or a model dir")
    parser.add_argument("--out", default=None, help="output directory (default bench/results/<gpu>-<date>)")
    args = parser.parse_args(argv)
    suite = importlib.import_module(f"bench.{args.suite}")
    report = suite.run(args.model)
    paths = report.write(args.out or default_out_dir())
    print(report.markdown())
    print("wrote", *paths, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
