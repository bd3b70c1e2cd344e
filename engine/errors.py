"""One small hierarchy of errors, each message naming the bad value, the limit and the fix."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A prompt or sampling setting the engine cannot serve. The engine stays usable."""


class KVPinnedError(EngineError):
    """Exported KV handles already pin so much of a cache that exporting one more request's K/V
    would leave too little for one max_model_len request; the message names the handles and how
    to free them. The engine stays usable (requests that export nothing are unaffected)."""


class ConfigError(EngineError, ValueError):
    """An engine or parallel setting that cannot work."""


class ModelLoadError(EngineError):
    """A model alias, path or checkpoint that cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint of an architecture the engine does not implement."""


class RankFailure(EngineError):
    """A rank died, hung or failed; the message names it and its node. The group is torn down:
    `LLM.restart()` (or a new LLM) serves again."""


class NumericalError(EngineError):
    """The model produced NaN or Inf logits for a request; that request fails, others go on."""
