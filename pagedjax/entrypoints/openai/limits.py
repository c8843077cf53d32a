"""The server's limits on what one request may ask for, and the errors that end a request.

Contract. Every limit is a flag with a default that keeps one request from taking the
server down (``ServerLimits``, ``add_limit_args``); docs/security.md lists them:

- ``--max-num-queued-reqs`` (vLLM's flag; alias ``--max-waiting-requests``): requests
  waiting for a scheduler slot beyond which a new one is answered 503 with
  ``Retry-After`` (``AsyncLLMEngine.max_waiting_requests``; counted in
  ``pagedjax:request_rejected_total{reason="queue_full"}``). Default 1024.
- ``--request-timeout``: seconds from a request's arrival to its last token; past it the
  request is aborted (its blocks freed) and ends with a 504 ``TimeoutError`` (in the
  stream, an error event, then ``[DONE]``). Default 3600 (an hour: long generations pass,
  a request stuck behind a hung client or a wedged queue does not hold blocks forever).
- ``--max-request-body-bytes`` (413; default 16 MiB, a 128k-token prompt as token ids
  is about 1 MiB), ``--max-json-depth`` (400; default 64), the body must be
  ``application/json`` (415; a missing content type is taken as JSON, as curl sends).
- ``--trust-request-chat-template`` (vLLM's flag, off by default): a request's own
  ``chat_template`` is a 400 unless it is on (a template is code the server runs).
- ``--max-messages`` (default 1024), ``--max-n`` (OpenAI's 128), ``--max-stop-strings``
  (64) and ``--max-stop-string-length`` (1024 characters: the stream holds back the
  longest stop string's length), each a 400 naming the field. ``logprobs`` and
  ``top_logprobs`` are bounded by the engine's ``--max-logprobs`` (vLLM's default 20),
  prompt length by ``--max-model-len`` (protocol.py, serving.py).

``read_json`` reads and checks a body (size while it arrives, content type, strict JSON:
no NaN / Infinity, no lone surrogates, depth); ``check_body`` applies the per-field
limits to the parsed object before validation (wrong types are left to protocol.py's
messages). ``error_for(e)`` maps what an engine stream raises to the OpenAIError a client
gets (one table for the handler, the stream and the disconnect watcher);
``with_deadline`` wraps a request's output stream with its timeout.

Cost: one pass over the parsed body (depth and strings), O(body size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pagedjax.engine.faults import StepFailedError
from pagedjax.engine.protocol import EngineDeadError
from pagedjax.entrypoints.async_engine import EngineRestartingError, QueueFullError
from pagedjax.entrypoints.openai.protocol import OpenAIError, bad

log = logging.getLogger("pagedjax.server")

MiB = 1 << 20
# Flags of this module vLLM 0.32 does not have (cli_args.PAGEDJAX_ONLY includes them).
PAGEDJAX_ONLY_LIMITS = (
    "--request-timeout", "--max-request-body-bytes", "--max-json-depth", "--max-messages",
    "--max-n", "--max-stop-strings", "--max-stop-string-length",
)  # fmt: skip


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits (module docstring). None for ``request_timeout_s``: none."""

    max_body_bytes: int = 16 * MiB
    max_json_depth: int = 64
    max_messages: int = 1024
    max_n: int = 128
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    request_timeout_s: float | None = 3600.0
    retry_after_s: int = 1  # Retry-After of a 503
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_messages", "max_n",
                     "max_stop_strings", "max_stop_string_length", "retry_after_s"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ServerLimits.{name} must be an integer >= 1, got {v!r}")
        t = self.request_timeout_s
        if t is not None and not t > 0:
            raise ValueError(f"ServerLimits.request_timeout_s must be > 0 or None, got {t!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        timeout = args.request_timeout
        return cls(
            max_body_bytes=args.max_request_body_bytes, max_json_depth=args.max_json_depth,
            max_messages=args.max_messages, max_n=args.max_n,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
            request_timeout_s=None if timeout is not None and timeout <= 0 else timeout,
            trust_request_chat_template=args.trust_request_chat_template,
        )  # fmt: skip


DEFAULT_MAX_QUEUED = 1024


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The limit flags (vLLM's names where vLLM has the limit)."""
    d = ServerLimits()
    own = "[pagedjax only] "
    p.add_argument(
        "--max-num-queued-reqs", "--max-waiting-requests", dest="max_waiting_requests",
        type=int, default=DEFAULT_MAX_QUEUED,
        help="answer 503 with Retry-After while this many requests wait for a scheduler slot"
        f" (default {DEFAULT_MAX_QUEUED}; 0 refuses any wait; --max-waiting-requests is"
        " pagedjax's older name)",
    )  # fmt: skip
    p.add_argument(
        "--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
        help="render a chat template sent in the request (vLLM's flag; default off: such a"
        " request is a 400, since a template is code the server runs, docs/security.md)",
    )  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help=own + "seconds a request may take, arrival to last token, before it"
                   " is aborted with a 504 (0: no limit)")  # fmt: skip
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_body_bytes,
                   help=own + "largest request body (413 beyond)")  # fmt: skip
    p.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                   help=own + "deepest JSON nesting of a request body")  # fmt: skip
    p.add_argument("--max-messages", type=int, default=d.max_messages,
                   help=own + "most chat messages in one request")  # fmt: skip
    p.add_argument("--max-n", type=int, default=d.max_n,
                   help=own + "largest 'n' (samples per prompt)")  # fmt: skip
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help=own + "most 'stop' strings in one request")  # fmt: skip
    p.add_argument("--max-stop-string-length", type=int, default=d.max_stop_string_length,
                   help=own + "longest 'stop' string, in characters")  # fmt: skip


# ------------------------------------------------------------------ errors


class LimitError(OpenAIError):
    """An OpenAIError with its own type name, headers and a metrics reason."""

    def __init__(self, status: int, message: str, *, type_name: str, param: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None):  # fmt: skip
        super().__init__(status, message, param)
        self._type, self.headers, self.reason = type_name, headers or {}, reason

    @property
    def type(self) -> str:
        return self._type


class RequestTimeoutError(RuntimeError):
    """The request ran past --request-timeout (it was aborted)."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down: the request was aborted (or never accepted)."""


def unavailable(message: str, reason: str, retry_after_s: int = 1) -> LimitError:
    return LimitError(503, message, type_name="ServiceUnavailableError",
                      headers={"Retry-After": str(retry_after_s)}, reason=reason)  # fmt: skip


def error_for(e: BaseException) -> OpenAIError:
    """The OpenAIError a client gets for what a request's engine stream raised."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError | TypeError):  # the engine refused the request
        return bad(str(e))
    if isinstance(e, QueueFullError):
        return unavailable(str(e), "queue_full")
    if isinstance(e, EngineRestartingError):
        return unavailable(str(e), "engine_restarting", 5)
    if isinstance(e, ShuttingDownError):
        return unavailable(str(e), "shutting_down", 5)
    if isinstance(e, RequestTimeoutError):
        return LimitError(504, str(e), type_name="TimeoutError", reason="timeout")
    if isinstance(e, StepFailedError | EngineDeadError):  # vLLM answers 500 too
        return OpenAIError(500, str(e))
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}")


def with_deadline(stream: AsyncIterator, seconds: float | None) -> AsyncIterator:
    """``stream`` ending with RequestTimeoutError ``seconds`` from now (closing it, which
    aborts its requests); ``stream`` itself when there is no limit."""
    return stream if seconds is None else _deadline(stream, seconds)


async def _deadline(stream: AsyncIterator, seconds: float) -> AsyncIterator:
    end = asyncio.get_running_loop().time() + seconds
    try:
        while True:
            try:
                async with asyncio.timeout_at(end):
                    item = await stream.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request took longer than {seconds:g} s (--request-timeout) and"
                    " was aborted"
                ) from None
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


# ------------------------------------------------------------------ bodies

_JSON_TYPES = ("application/json",)


def _reject_constant(name: str) -> Any:
    raise bad(f"malformed JSON body: {name} is not valid JSON")


async def read_json(request: Request, limits: ServerLimits) -> Any:
    """The request body as strict JSON within the limits (module docstring)."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        media = ctype.split(";", 1)[0].strip().lower()
        if media not in _JSON_TYPES and not media.endswith("+json"):
            raise LimitError(415, f"the request body must be application/json, got {ctype!r}",
                             type_name="UnsupportedMediaTypeError")  # fmt: skip
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise _too_large(int(declared), cap)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise _too_large(size, cap)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad("the request body is empty (a JSON object is required)")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except OpenAIError:
        raise
    except RecursionError:
        raise _too_deep(limits.max_json_depth) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, huge ints, bad UTF-8
        raise bad(f"malformed JSON body: {e}") from None
    _walk(body, limits.max_json_depth)
    return body


def _too_large(size: int, cap: int) -> LimitError:
    return LimitError(413, f"the request body has at least {size} bytes, more than"
                      f" --max-request-body-bytes {cap}", type_name="RequestTooLargeError",
                      reason="too_large")  # fmt: skip


def _too_deep(depth: int) -> OpenAIError:
    return bad(f"the request body nests JSON deeper than --max-json-depth {depth}")


def _walk(body: Any, max_depth: int) -> None:
    """Depth and strings (no lone surrogates: they cannot be encoded as UTF-8), iteratively."""
    stack = [(body, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, dict | list):
            if depth > max_depth:
                raise _too_deep(max_depth)
            items = x.items() if isinstance(x, dict) else ((None, v) for v in x)
            for k, v in items:
                if k is not None:
                    _check_str(k)
                stack.append((v, depth + 1))
        elif isinstance(x, str):
            _check_str(x)


def _check_str(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise bad("the request body has a string that is not valid Unicode (a lone"
                      " surrogate escape)") from None  # fmt: skip


def check_body(body: Any, limits: ServerLimits) -> None:
    """The per-field limits (module docstring) on a parsed body; fields of the wrong type
    are left for the validator to name."""
    if not isinstance(body, dict):
        return
    kwargs = body.get("chat_template_kwargs")
    sent = body.get("chat_template") is not None or (
        isinstance(kwargs, dict) and kwargs.get("chat_template") is not None)  # fmt: skip
    if sent and not limits.trust_request_chat_template:
        raise bad("a chat template in the request is refused: the server runs only its own"
                  " (start it with --trust-request-chat-template to allow them)",
                  "chat_template")  # fmt: skip
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise bad(f"'messages' has {len(messages)} messages, more than --max-messages"
                  f" {limits.max_messages}", "messages")  # fmt: skip
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > limits.max_n:
        raise bad(f"'n' must be at most {limits.max_n} (--max-n), got {n}", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise bad(f"'stop' has {len(stop)} strings, more than --max-stop-strings"
                      f" {limits.max_stop_strings}", "stop")  # fmt: skip
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        cap = limits.max_stop_string_length
        if longest > cap:
            raise bad(f"a 'stop' string has {longest} characters, more than"
                      f" --max-stop-string-length {cap}", "stop")  # fmt: skip


__all__ = [
    "DEFAULT_MAX_QUEUED", "LimitError", "PAGEDJAX_ONLY_LIMITS",
    "RequestTimeoutError", "ServerLimits", "ShuttingDownError", "add_limit_args",
    "check_body", "error_for", "read_json", "unavailable", "with_deadline",
]  # fmt: skip
