"""One small hierarchy of errors, each message naming the bad value, the limit and the fix."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A prompt or sampling setting the engine cannot serve. The engine stays usable."""


class ConfigError(EngineError, ValueError):
    """An engine or parallel setting that cannot work."""


class ModelLoadError(EngineError):
    """A model alias, path or checkpoint that cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint of an architecture the engine does not implement."""
