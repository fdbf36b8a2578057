"""The OpenAI-compatible request bodies, validated with pydantic.

Fields that mean something for a dLLM are honoured; fields that would be silently ignored
(log-probabilities, nucleus sampling, tools, penalties, ...) are refused with a 400 naming the
field; unknown fields are refused too. `decoder` (our spec grammar) is the one extension.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from unmask.errors import InputError, lone_surrogate

# Prompts per completion request. Each is its own engine request, submitted one engine round
# trip at a time (EngineClient.submit; a round trip waits for the step in flight), so a long
# list keeps its handler submitting for seconds; 64 covers evaluation harnesses' batches, and a
# larger batch can be split over several requests, which the engine batches together all the same.
MAX_PROMPTS = 64

# JSON's \uXXXX escapes can spell half of a UTF-16 surrogate pair on its own: Python keeps it in
# the str, but it is not a character, and the tokenizer (a UTF-8 codec) fails on it.


def check_text(text: str, field: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate), naming the field."""
    why = lone_surrogate(text)
    if why is not None:
        raise FieldError(field, f"{field} is not valid Unicode text: {why}")


# strict: pydantic's lax mode would read "8" or true as max_tokens, "yes" as stream=true; OpenAI
# refuses a value of the wrong JSON type, and silently reinterpreting one changes the answer.
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # allow_inf_nan: JSON's Infinity/NaN extensions reach the field as floats; refused here, by
    # the field's name (the decoder spec would refuse them too, but as `decoder`'s fault)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # choices per prompt: sample j decodes with seed + j (j = 0: the request's own answer)
    n: int = Field(default=1, ge=1, le=MAX_PROMPTS)
    user: str | None = None  # an end-user id for the caller's own records; not used
    decoder: str | None = None  # unmask's decoder spec; the server's --decoder when absent
    # nucleus sampling: the decoder's own top_p (tokens sampled at temperature > 0)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    # Accepted only at the value that means "off": anything else would be silently ignored.
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    # Structured output (docs/serving.md): OpenAI's response_format; a regular expression under
    # SGLang's name (`regex`) or vLLM's (`guided_regex`), so their clients work unchanged.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    guided_regex: str | None = None
    # The length prior's weight on the constraint above (docs/decoders.md § Structured output;
    # None: the format's default); checked where the constraint is built, naming this field
    length_penalty: float | None = Field(default=None, allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    def _logprobs_off(self) -> bool:
        """Chat's logprobs is a flag: false is off. (Identity, since 0 == False in Python.)"""
        return self.logprobs is None or self.logprobs is False

    def check_supported(self) -> None:
        """Refuse values the engine would silently ignore, naming the field."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise Unsupported(name, "penalties are not implemented")
        if not self._logprobs_off():
            raise Unsupported("logprobs", "log-probabilities are not returned")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit biases are not implemented")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options needs stream=true")
        for stop in self.stop or []:
            check_text(stop, "stop")
        given = [name for name in ("response_format", "regex", "guided_regex")
                 if getattr(self, name) not in (None, {"type": "text"})]
        if len(given) > 1:
            raise FieldError(given[1], f"one constraint per request: {given[0]} and {given[1]} "
                                       f"are both set")

    def constraint_field(self) -> str | None:
        """The field that holds the request's structured-output constraint (None: none)."""
        for name in ("response_format", "regex", "guided_regex"):
            if getattr(self, name) not in (None, {"type": "text"}):
                return name
        return None


class CompletionRequest(_Common):
    # OpenAI's four prompt forms: a string, strings, token ids, or lists of token ids. Token ids
    # go to the engine as they are (no chat template); lm-eval's local-completions sends them.
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _logprobs_off(self) -> bool:
        """A completion's logprobs is a count of alternatives, and 0 still asks for the sampled
        token's log-probability: only absent (null) is off."""
        return self.logprobs is None

    def prompts(self) -> list[str] | list[list[int]]:
        if self._single():
            return [self.prompt]
        return list(self.prompt)

    def prompt_field(self, i: int) -> str:
        """The field that holds prompt i, for error messages: `prompt` or `prompt[i]`."""
        return "prompt" if self._single() else f"prompt[{i}]"

    def _single(self) -> bool:
        return isinstance(self.prompt, str) or bool(self.prompt and isinstance(self.prompt[0], int))

    def check_supported(self) -> None:
        super().check_supported()
        prompts = self.prompts()
        if not prompts:
            raise Unsupported("prompt", "prompt must not be an empty list")
        if len(prompts) > MAX_PROMPTS:
            raise FieldError("prompt", f"{len(prompts)} prompts in one request; the limit is "
                                       f"{MAX_PROMPTS} per request (send the rest in further "
                                       f"requests)")
        if len(prompts) * self.n > MAX_PROMPTS:
            raise FieldError("n", f"{len(prompts)} prompts x n={self.n} choices in one request; "
                                  f"the limit is {MAX_PROMPTS} choices per request")
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                check_text(p, self.prompt_field(i))
        if self.echo:
            raise Unsupported("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", "best_of is not supported")
        if self.suffix:
            raise Unsupported("suffix", "insertion (suffix) is not supported")


class ChatMessage(BaseModel):
    model_config = _STRICT
    # "developer" is OpenAI's newer name for system instructions; templates know "system"
    role: Literal["system", "developer", "user", "assistant"]
    # a string, or OpenAI's list of content parts, of which text parts are served (checked in
    # ChatCompletionRequest.check_supported, so a refused part is named by its place)
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM joins them."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out

    def check_parts(self, field: str) -> None:
        """Refuse content parts other than {"type": "text", "text": ...}, naming the part."""
        if isinstance(self.content, str):
            check_text(self.content, field)
            return
        for j, part in enumerate(self.content):
            at = f"{field}[{j}]"
            kind = part.get("type")
            if kind != "text":
                raise Unsupported(f"{at}.type", f"only text content parts are served, not "
                                                f"{kind!r} (this model reads text alone)")
            if not isinstance(part.get("text"), str):
                raise FieldError(f"{at}.text", f"{at}.text: expected a string")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                name = f"{at}.{extra[0]}"
                raise FieldError(name, f"unknown field {name!r} in a text part")
            check_text(part["text"], f"{at}.text")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise Unsupported(name, "tool and function calling are not supported")
        if self.top_logprobs:
            raise Unsupported("top_logprobs", "log-probabilities are not returned")
        for i, m in enumerate(self.messages):
            m.check_parts(f"messages[{i}].content")
            if m.name is not None:
                check_text(m.name, f"messages[{i}].name")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise Unsupported("max_completion_tokens", "differs from max_tokens")
            self.max_tokens = self.max_completion_tokens


class FieldError(InputError):
    """A request field with a value the server refuses; `field` names it (the error's param;
    None when the request as a whole is refused)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


class Unsupported(FieldError):
    """A request field the server refuses (it would otherwise be silently ignored)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(field, f"unsupported value for field {field!r}: {why}")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
