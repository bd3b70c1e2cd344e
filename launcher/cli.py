"""`prefill <app> [hydra overrides]`: one console script for every Hydra app."""
from __future__ import annotations

import importlib
import sys

from engine.cpu_runtime import relaunch_preloaded

APPS = {"generate": "launcher.generate", "walkthrough": "launcher.walkthrough",
        "bench": "launcher.bench", "score": "launcher.score", "disagg": "launcher.disagg",
        "serve": "launcher.serve"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in APPS:
        print(f"usage: prefill {{{'|'.join(APPS)}}} [key=value ...]", file=sys.stderr)
        sys.exit(2)
    relaunch_preloaded()  # Intel's OpenMP and tcmalloc, where they win here
    app = sys.argv.pop(1)
    importlib.import_module(APPS[app]).main()
