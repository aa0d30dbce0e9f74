"""`python -m engine generate|serve ...`: engine/entrypoints/cli.py."""
import sys

from engine.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
