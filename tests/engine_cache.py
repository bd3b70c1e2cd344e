"""An engine cache folder of a test's own: no kernel timing, graph or runtime choice kept by an
earlier start is read. Its C++ libraries are the test run's (the `kernels` folder of the cache
conftest sets, linked): they are keyed by source, compiler, CPU and torch, so sharing them
changes no choice, and a run builds each once instead of once per test (~40 s for the three)."""
from __future__ import annotations

import os
from pathlib import Path

RUN_KERNELS = Path(os.environ["PREFILL_ENGINE_CACHE"]) / "kernels"  # conftest set it already


def fresh_cache(folder: Path) -> Path:
    """`folder`, made, with the run's C++ libraries in it; everything else it holds is its
    own. Not for a test that damages or counts the built libraries (it would damage the run's)."""
    folder.mkdir(parents=True, exist_ok=True)
    RUN_KERNELS.mkdir(parents=True, exist_ok=True)
    if not (folder / "kernels").exists():
        (folder / "kernels").symlink_to(RUN_KERNELS, target_is_directory=True)
    return folder
