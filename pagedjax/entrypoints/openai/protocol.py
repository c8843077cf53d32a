"""OpenAI request validation and error shape (vLLM's OpenAI layer, field by field).

A request body (parsed JSON) becomes a ``CompletionRequest`` or ``ChatRequest`` with
SamplingParams, or an ``OpenAIError`` naming the field. Rules:

- wrong types and out-of-range values: 400, ``param`` names the field; no coercion
  ("5" is not an int; true is not a number);
- fields the server does not know: accepted and logged as a warning (vLLM's behaviour);
- fields it knows but does not support (``suffix``, ``skip_special_tokens: false``,
  ...): 400 naming the field.

Structured outputs, logit controls (structured.py) and tools (tools.py) are read by
their own modules; this one only lists their names as known.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with vLLM's type names
(BadRequestError, AuthenticationError, NotFoundError, ServiceUnavailableError, ...).
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedjax.sampling import SamplingParams

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error answered as OpenAI's JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "InternalServerError")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


# ---------------------------------------------------------------- field readers

_MISSING = object()


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)  # fmt: skip


class JsonFields:
    """Reads typed fields off a JSON object, remembering which names were read."""

    def __init__(self, body: Any, known: set[str]):
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, got {_type_name(body)}")
        self.body = body
        self.known = known

    def get(self, name: str, default: Any = None) -> Any:
        v = self.body.get(name, _MISSING)
        return default if v is _MISSING or v is None else v

    def int(self, name: str, default: Any = None, lo: int | None = None, hi: int | None = None):
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"'{name}' must be an integer, got {_type_name(v)} {v!r}", name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}",
                      name)  # fmt: skip
        return v

    def float(self, name: str, default: Any, lo: float, hi: float, lo_open: bool = False):
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise bad(f"'{name}' must be a finite number, got {_type_name(v)} {v!r}", name)
        if v < lo or v > hi or (lo_open and v == lo):
            left = "(" if lo_open else "["
            raise bad(f"'{name}' must be in {left}{lo}, {hi}], got {v}", name)
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise bad(f"'{name}' must be a boolean, got {_type_name(v)} {v!r}", name)
        return v

    def str(self, name: str, default: Any = None) -> Any:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if not isinstance(v, str):
            raise bad(f"'{name}' must be a string, got {_type_name(v)}", name)
        return v

    def warn_unknown(self, kind: str) -> list[str]:
        unknown = sorted(set(self.body) - self.known)
        if unknown:
            log.warning("%s request: ignoring unknown fields %s", kind, unknown)
        return unknown


_SAMPLING_FIELDS = {
    "model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "stream", "stream_options", "best_of",
    # vLLM's extras (clients send them through extra_body)
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "min_tokens", "include_stop_str_in_output",
    "spaces_between_special_tokens", "prompt_logprobs", "add_special_tokens",
    "request_id",
    # structured.py
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "allowed_token_ids", "bad_words",
}  # fmt: skip
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "logprobs", "suffix"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "add_generation_prompt", "continue_final_message", "chat_template", "echo",
    "store", "metadata", "service_tier", "modalities", "reasoning_effort",
    "chat_template_kwargs", "include_reasoning",
}  # fmt: skip


@dataclass
class ParsedRequest:
    """What both endpoints share after validation.

    prompts: per prompt, text or token ids (completions may hold several; chat one).
    max_tokens: None = up to the context length. logprobs: top-k per token (None = off).
    """

    model: str | None
    prompts: list[str | list[int]]
    params_kwargs: dict[str, Any]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool
    logprobs: int | None
    add_special_tokens: bool
    request_id: str | None
    unknown: list[str] = field(default_factory=list)
    # chat only
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs,
                                  **self.params_kwargs)  # fmt: skip
        except (ValueError, TypeError) as e:  # ranges double-checked by SamplingParams
            param = next((f for f in ("min_tokens", "structured_outputs") if str(e).startswith(f)),
                         None)  # fmt: skip
            raise bad(str(e), param) from e


def _common(b: JsonFields, max_logprobs: int) -> dict[str, Any]:
    """Sampling fields shared by completions and chat."""
    out: dict[str, Any] = {}
    out["n"] = b.int("n", 1, lo=1, hi=128)
    best_of = b.int("best_of", None, lo=1)
    if best_of is not None and best_of != out["n"]:
        raise bad("'best_of' different from 'n' is not supported", "best_of")
    out["temperature"] = b.float("temperature", 1.0, 0.0, 2.0)
    out["top_p"] = b.float("top_p", 1.0, 0.0, 1.0, lo_open=True)
    out["presence_penalty"] = b.float("presence_penalty", 0.0, -2.0, 2.0)
    out["frequency_penalty"] = b.float("frequency_penalty", 0.0, -2.0, 2.0)
    out["repetition_penalty"] = b.float("repetition_penalty", 1.0, 0.0, 1e9, lo_open=True)
    out["min_p"] = b.float("min_p", 0.0, 0.0, 1.0)
    top_k = b.int("top_k", -1, lo=-1)
    out["top_k"] = top_k
    out["seed"] = b.int("seed", None, lo=0, hi=2**32 - 1)
    out["ignore_eos"] = b.bool("ignore_eos", False)
    stop = b.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad("'stop' must be a string or an array of strings", "stop")
        if len(items) > 4 and not isinstance(stop, str):
            log.debug("stop has %d strings (OpenAI allows 4; vLLM any)", len(items))
        if any(s == "" for s in items):
            raise bad("'stop' must not contain an empty string", "stop")
        out["stop"] = items
    ids = b.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise bad("'stop_token_ids' must be an array of non-negative integers",
                      "stop_token_ids")  # fmt: skip
        out["stop_token_ids"] = ids
    if b.bool("include_stop_str_in_output", False):
        raise bad("'include_stop_str_in_output' is not supported by this server yet",
                  "include_stop_str_in_output")  # fmt: skip
    if not b.bool("skip_special_tokens", True):
        raise bad("'skip_special_tokens': false is not supported by this server yet",
                  "skip_special_tokens")  # fmt: skip
    b.bool("spaces_between_special_tokens", True)
    if b.get("prompt_logprobs") is not None:
        raise bad("'prompt_logprobs' is not supported by this server yet", "prompt_logprobs")
    b.str("user")
    return out


def _stream_opts(b: JsonFields) -> tuple[bool, bool, bool]:
    stream = b.bool("stream", False)
    opts = b.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        ob = JsonFields(opts, {"include_usage", "continuous_usage_stats"})
        include_usage = ob.bool("include_usage", False)
        continuous = ob.bool("continuous_usage_stats", False)
    return stream, include_usage, continuous


def _token_ids(v: Any, vocab_size: int, param: str) -> list[int]:
    for i in v:
        if isinstance(i, bool) or not isinstance(i, int):
            raise bad(f"'{param}' token ids must be integers, got {_type_name(i)}", param)
        if not 0 <= i < vocab_size:
            raise bad(f"'{param}' token id {i} is outside the vocabulary [0, {vocab_size})",
                      param)  # fmt: skip
    return list(v)


def parse_completion(body: Any, *, vocab_size: int, max_logprobs: int) -> ParsedRequest:
    b = JsonFields(body, COMPLETION_FIELDS)
    prompt = b.get("prompt", _MISSING)
    if prompt is _MISSING:
        raise bad("'prompt' is required", "prompt")
    # A str, a list of ints, a list of strs, or a list of lists of ints.
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(x, int) and not isinstance(x, bool) for x in prompt
    ):
        prompts = [_token_ids(prompt, vocab_size, "prompt")]
    elif isinstance(prompt, list) and prompt:
        prompts = []
        for x in prompt:
            if isinstance(x, str):
                prompts.append(x)
            elif isinstance(x, list) and x:
                prompts.append(_token_ids(x, vocab_size, "prompt"))
            else:
                raise bad("'prompt' must be a string, an array of token ids, or an array of"
                          " either (non-empty)", "prompt")  # fmt: skip
    else:
        raise bad("'prompt' must be a string, an array of token ids, or an array of either"
                  " (non-empty)", "prompt")  # fmt: skip
    if any(p == "" for p in prompts):
        raise bad("'prompt' must not be empty", "prompt")
    suffix = b.get("suffix")
    if suffix is not None:
        raise bad("'suffix' is not supported by this server", "suffix")
    kwargs = _common(b, max_logprobs)
    logprobs = b.int("logprobs", None, lo=0, hi=max_logprobs)
    echo = b.bool("echo", False)
    if echo and logprobs is not None:
        raise bad("'echo' together with 'logprobs' is not supported by this server yet", "echo")
    stream, include_usage, continuous = _stream_opts(b)
    return ParsedRequest(
        model=b.str("model"),
        prompts=prompts,
        params_kwargs=kwargs,
        max_tokens=b.int("max_tokens", 16, lo=1),  # OpenAI's completions default
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        echo=echo,
        logprobs=logprobs,
        add_special_tokens=b.bool("add_special_tokens", True),
        request_id=b.str("request_id"),
        unknown=b.warn_unknown("completion"),
    )


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}",
                      "messages")  # fmt: skip
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        images: list[bytes | MediaURL] = []
        if isinstance(content, list):  # content parts: text, and images (data: or a URL)
            texts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images.append(image_source(part.get("image_url"), i))
                    continue
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                    raise bad(f"messages[{i}].content: only 'text' and 'image_url' parts are"
                              f" supported, got {kind!r}", "messages")  # fmt: skip
                if not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content text part needs a string 'text'",
                              "messages")  # fmt: skip
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or an array of text parts",
                      "messages")  # fmt: skip
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if images:  # the server writes the model's placeholders (serving.chat)
            msg["images"] = images
        out.append(msg)
    return out


class MediaURL(NamedTuple):
    """An http(s) or file image URL of message ``message``, for the server to fetch
    (``media.MediaFetchPolicy``: its rules)."""

    url: str
    message: int


def image_source(value: Any, i: int) -> bytes | MediaURL:
    """An ``image_url`` part's image: the bytes of a ``data:`` URL, or the http(s) / file
    URL to fetch (the server does, under its rules: media.py). The bytes are decoded
    later (serving.chat): corrupt ones are a 400 there."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise bad(f"messages[{i}].content image_url part needs a string 'url'", "messages")
    if url.split(":", 1)[0].lower() in ("http", "https", "file"):
        return MediaURL(url, i)
    return image_url_bytes(value, i)


def image_url_bytes(value: Any, i: int) -> bytes:
    """An ``image_url`` part's image bytes: only ``data:`` URLs (base64); http(s) and file
    URLs are a 400 naming the rule (``LLM.chat`` fetches nothing; the server fetches them
    through ``image_source``)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise bad(f"messages[{i}].content image_url part needs a string 'url'", "messages")
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("http", "https", "file"):
        raise bad(f"messages[{i}]: {scheme} image URLs are not fetched here; send the image"
                  " inline as a data: URL (data:image/png;base64,...), or through the"
                  " server (--allowed-media-domains, --allowed-local-media-path)",
                  "messages")  # fmt: skip
    head, sep, payload = url.partition(",")
    if scheme != "data" or not sep or not head.endswith(";base64"):
        raise bad(f"messages[{i}]: an image URL must be data:<type>;base64,<data>",
                  "messages")  # fmt: skip
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad(f"messages[{i}]: the image data URL is not valid base64: {e}",
                  "messages") from None  # fmt: skip


def parse_chat(body: Any, *, vocab_size: int, max_logprobs: int) -> ParsedRequest:
    b = JsonFields(body, CHAT_FIELDS)
    messages = parse_messages(b.body.get("messages"))
    kwargs = _common(b, max_logprobs)
    want_lp = b.bool("logprobs", False)
    top = b.int("top_logprobs", None, lo=0, hi=max_logprobs)
    if top is not None and not want_lp:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    mct = b.int("max_completion_tokens", None, lo=1)
    mt = b.int("max_tokens", None, lo=1)
    if b.bool("echo", False):
        raise bad("'echo' is not supported for chat by this server", "echo")
    if b.bool("continue_final_message", False):
        raise bad("'continue_final_message' is not supported by this server yet",
                  "continue_final_message")  # fmt: skip
    stream, include_usage, continuous = _stream_opts(b)
    return ParsedRequest(
        model=b.str("model"),
        prompts=[],
        params_kwargs=kwargs,
        max_tokens=mct if mct is not None else mt,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        echo=False,
        logprobs=(top or 0) if want_lp else None,
        add_special_tokens=b.bool("add_special_tokens", False),
        request_id=b.str("request_id"),
        unknown=b.warn_unknown("chat completion"),
        messages=messages,
        add_generation_prompt=b.bool("add_generation_prompt", True),
        chat_template=b.str("chat_template"),
    )
