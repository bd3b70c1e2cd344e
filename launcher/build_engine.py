"""Turning a Hydra config into an engine."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from engine import LLM

# absolute, so the apps find conf/ however they are started (python -m, console script, ray job)
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def engine_settings(cfg: DictConfig) -> dict:
    """`engine.*` and `parallel.*` keys are `LLM(...)` keyword arguments, one to one."""
    return {**OmegaConf.to_container(cfg.engine), **OmegaConf.to_container(cfg.parallel)}


def llm_from_config(cfg: DictConfig) -> LLM:
    return LLM(cfg.model.path, **engine_settings(cfg))
