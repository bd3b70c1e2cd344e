"""The request bodies of OpenAI's completions and chat completions APIs, as far as this server
serves them, and their translation to the engine's SamplingParams. Fields OpenAI has and this
engine cannot honour (best_of, logit_bias, presence/frequency penalties, ...) are refused by name
rather than silently ignored."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import SamplingParams

# OpenAI fields a client may send at their neutral value; any other value is refused by name
NEUTRAL = {"best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "logit_bias": (None, {}), "suffix": (None, ""), "user": None}  # None: any value


class ServeError(Exception):
    """A request this server refuses: its HTTP status and OpenAI error type go with it."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def __reduce__(self):  # crosses Ray Serve's process boundary with its status intact
        return ServeError, (self.status, str(self), self.kind, self.code, self.param)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share: sampling, stopping, streaming."""

    # strict: `"max_tokens": true` or `"5"` is refused, not read as 1 or 5; unknown fields are
    # checked in `refuse_unknown`
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # an extension, as vLLM's; 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension, as vLLM's: generate exactly max_tokens

    def refuse_unknown(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL and (NEUTRAL[name] is None or value in NEUTRAL[name]):
                continue
            raise ServeError(400, f"{name}={value!r} is not supported by this server; leave it "
                             f"out", param=name)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ServeError(400, "stop strings must be non-empty", param="stop")
        return stops

    def sampling_params(self, default_max_tokens: int, choice: int) -> SamplingParams:
        """The engine's params for choice `choice` of n: with a seed, each choice draws from
        its own (seed + choice), so n choices differ yet the request is reproducible."""
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              seed=seed, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise ServeError(400, "prompt is empty: give a string, token ids, or a list of "
                             "them", param="prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts of any type other than text are refused, and so is
        a missing content, except an assistant's (a turn that called tools has none)."""
        if self.content is None and self.role != "assistant":
            raise ServeError(400, f"a {self.role} message without content: give its text as "
                             f"\"content\": a string or a list of text parts", param="messages")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServeError(400, f"content part of type {part.get('type')!r}: this server "
                                 f"reads only text parts", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def turns(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
