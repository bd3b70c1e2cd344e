"""How every Hydra app starts and how it ends on bad input.

A bad key (a value the app or the engine refuses, a model that does not load) ends the app with
one line on stderr naming the key, the value and the fix, and exit code 2, as a command-line tool's
usage errors do; Hydra's own report of a bad override (an unknown key, a value of the wrong type)
is given the same way. The traceback comes only with HYDRA_FULL_ERROR=1. Anything else is a bug and keeps Hydra's report.
"""
from __future__ import annotations

import functools
import io
import os
import sys
from typing import Any, Callable, NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

from engine.errors import ConfigError, InvalidRequestError, ModelLoadError
from launcher.build_engine import CONF_DIR

USAGE_ERROR = 2


class BadSetting(ValueError):
    """A key of a Hydra app whose value cannot be used; the message names it and the fix."""


BAD_INPUT = (BadSetting, ConfigError, InvalidRequestError, ModelLoadError)


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], None]]:
    """`@hydra_app("generate")` on `task(cfg)`: the console entry point, `main()`."""
    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], None]:
        held = _HeldStderr()

        @functools.wraps(task)
        def guarded(cfg: DictConfig) -> Any:
            held.release()  # the config composed: from here on the app writes as it likes
            try:
                return task(cfg)
            except BAD_INPUT as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                _usage_error(str(e))

        hydra_main = hydra.main(version_base=None, config_path=CONF_DIR,
                                config_name=config_name)(guarded)

        @functools.wraps(task)  # main.__wrapped__(cfg) runs the task on a composed config
        def main() -> None:
            held.hold()
            try:
                hydra_main()
            except SystemExit as e:
                said = held.release()
                if e.code == 1 and said is not None:  # Hydra refused an override: its report
                    _usage_error(said.split("\nSet the environment variable")[0])
                raise
            finally:
                held.release()
        return main
    return decorate


class _HeldStderr:
    """stderr kept aside until the task starts, so that Hydra's report of a bad override can
    be given as one line."""

    def __init__(self) -> None:
        self._real: Any = None
        self._buffer: io.StringIO | None = None

    def hold(self) -> None:
        self._real, self._buffer = sys.stderr, io.StringIO()
        sys.stderr = self._buffer

    def release(self) -> str | None:
        """Back to the real stderr; what was held (None if nothing was held)."""
        if self._buffer is None:
            return None
        held, self._buffer = self._buffer.getvalue(), None
        sys.stderr = self._real
        return held


def _usage_error(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever it held
    sys.exit(USAGE_ERROR)


def integer(cfg: DictConfig, key: str, minimum: int = 1, allow_none: bool = False) -> int | None:
    """cfg's `key` (a dotted path), checked to be an integer >= minimum (or null, if allowed)."""
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return None
    if type(value) is not int or value < minimum:
        also = "null or " if allow_none else ""
        raise BadSetting(f"{key}={value!r}: use {also}an integer >= {minimum}")
    return value


def number(cfg: DictConfig, key: str, minimum: float = 0.0) -> float:
    """cfg's `key`, checked to be a finite number >= minimum."""
    value = OmegaConf.select(cfg, key)
    ok = type(value) in (int, float) and value == value and abs(value) != float("inf")
    if not ok or value < minimum:
        raise BadSetting(f"{key}={value!r}: use a finite number >= {minimum:g}")
    return float(value)


def text(cfg: DictConfig, key: str) -> str:
    """cfg's `key`, checked to be non-empty text."""
    value = OmegaConf.select(cfg, key)
    if not isinstance(value, str) or not value:
        raise BadSetting(f"{key}={value!r}: give non-empty text (quote it if Hydra reads it as "
                         f"a number: {key}='\"...\"')")
    return value


def boolean(cfg: DictConfig, key: str) -> bool:
    value = OmegaConf.select(cfg, key)
    if type(value) is not bool:
        raise BadSetting(f"{key}={value!r}: use true or false")
    return value
