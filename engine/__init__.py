"""A tensor-parallel LLM prefill engine."""
from engine.errors import (ConfigError, EngineError, InvalidRequestError, KVPinnedError,
                           ModelLoadError, NumericalError, RankFailure, UnsupportedModelError)
from engine.llm import LLM
from engine.driver.outputs import GenerateOutput, PrefillOutput, ScoreOutput
from engine.driver.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "PrefillOutput", "GenerateOutput", "ScoreOutput",
           "EngineError", "InvalidRequestError", "ConfigError", "ModelLoadError",
           "UnsupportedModelError", "RankFailure", "NumericalError", "KVPinnedError"]
