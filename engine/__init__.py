"""A tensor-parallel LLM prefill engine.

The classes below load on first use, not with the package: a launcher's first act is to start
itself again with Intel's OpenMP preloaded (engine.cpu_runtime), and a process about to be
replaced that had imported torch on the way would have spent ~2 s for nothing."""
from __future__ import annotations

import importlib

from engine.errors import (ConfigError, EngineError, InvalidRequestError, KVPinnedError,
                           ModelLoadError, NumericalError, RankFailure, UnsupportedModelError)

_LOADED_ON_USE = {"LLM": "engine.llm", "SamplingParams": "engine.driver.sampling_params",
                  "PrefillOutput": "engine.driver.outputs",
                  "GenerateOutput": "engine.driver.outputs",
                  "ScoreOutput": "engine.driver.outputs"}

__all__ = [*_LOADED_ON_USE, "EngineError", "InvalidRequestError", "ConfigError",
           "ModelLoadError", "UnsupportedModelError", "RankFailure", "NumericalError",
           "KVPinnedError"]


def __getattr__(name: str) -> object:
    if name not in _LOADED_ON_USE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LOADED_ON_USE[name]), name)
    globals()[name] = value  # found directly from now on
    return value
