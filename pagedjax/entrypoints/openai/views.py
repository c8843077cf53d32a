"""OpenAI response bodies and SSE chunks from the engine's cumulative RequestOutputs.

One view per endpoint (completions, chat): ``full`` builds the non-streamed response,
``sse`` the ``data: {...}`` chunks ending with ``data: [DONE]``, each choice's state
(``ChoiceState``) saying what a stream already sent. Streaming text is held back by
(longest stop string - 1) characters until the request finishes, because a stop string
that spans tokens truncates text that would otherwise already have been sent. The
handlers that make a view are ``serving.OpenAIServing``'s; the view reads only the
serving object's ``names``, ``tokenizer`` and ``response_role``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedjax.engine.outputs import CompletionOutput, RequestOutput
from pagedjax.entrypoints.openai.chat_output import OutputRules
from pagedjax.entrypoints.openai.limits import error_for
from pagedjax.entrypoints.openai.protocol import ParsedRequest


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {_dumps(obj)}\n\n"


class ChoiceState:
    """What a stream already sent for one choice."""

    __slots__ = ("text", "tokens", "finished", "started", "stream")

    def __init__(self) -> None:
        self.text = 0  # characters sent
        self.tokens = 0  # tokens whose logprobs were sent
        self.finished = False
        self.started = False
        self.stream: Any = None  # chat: its ChoiceStream (chat_output.py)


class View:
    object_full = ""
    object_chunk = ""

    def __init__(self, serving: Any, parsed: ParsedRequest, rid: str):
        self.s, self.p, self.rid = serving, parsed, rid
        self.created = int(time.time())
        self.model = parsed.model or serving.names[0]
        stops = parsed.params_kwargs.get("stop") or []
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.n = parsed.params_kwargs["n"]

    def envelope(self, choices: list[dict], outs: list[RequestOutput | None]) -> dict:
        """The non-streamed response object around ``choices`` (completion or chat)."""
        return {
            "id": self.rid,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(outs),
        }

    def usage(self, outs: list[RequestOutput | None]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs if o is not None)
        completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {
            "id": self.rid,
            "object": self.object_chunk,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    async def sse(self, first, stream, n_prompts: int) -> AsyncIterator[str]:
        states = [[ChoiceState() for _ in range(self.n)] for _ in range(n_prompts)]
        latest: list[RequestOutput | None] = [None] * n_prompts
        try:
            item = first
            while True:
                i, out = item
                latest[i] = out
                for c in out.outputs:
                    st = states[i][c.index]
                    if st.finished:
                        continue
                    choice = self.delta(i, out, c, st)
                    if choice is not None:
                        usage = self.usage(latest) if self.p.continuous_usage else None
                        yield sse(self.chunk([choice], usage))
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    break
            if self.p.include_usage:
                yield sse(self.chunk([], self.usage(latest)))
        except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the
            yield sse(error_for(e).body())  # stream, as vLLM does (limits.error_for)
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    def new_text(self, c: CompletionOutput, st: ChoiceState) -> str:
        end = len(c.text) if c.finish_reason is not None else max(len(c.text) - self.hold, 0)
        if end <= st.text:
            return ""
        delta = c.text[st.text : end]
        st.text = end
        return delta

    def delta(self, i: int, out: RequestOutput, c: CompletionOutput, st: ChoiceState):
        raise NotImplementedError

    def full(self, outs: list[RequestOutput]) -> dict:
        raise NotImplementedError


class CompletionView(View):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def delta(self, i, out, c, st):
        text = ""
        offset = st.text
        if not st.started:
            st.started = True
            if self.p.echo:
                text = self._prompt_text(out)
        text += self.new_text(c, st)
        lp = None
        if self.p.logprobs is not None and c.logprobs is not None:
            lp = completion_logprobs(c, st.tokens, len(c.logprobs), offset)
            st.tokens = len(c.logprobs)
        if c.finish_reason is not None:
            st.finished = True
        if not text and c.finish_reason is None and not (lp and lp["tokens"]):
            return None
        return {
            "index": i * self.n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.s.tokenizer.decode(out.prompt_token_ids)

    def full(self, outs):
        choices = []
        for i, out in enumerate(outs):
            prefix = self._prompt_text(out) if self.p.echo else ""
            for c in out.outputs:
                lp = None
                if self.p.logprobs is not None and c.logprobs is not None:
                    lp = completion_logprobs(c, 0, len(c.logprobs), 0)
                choices.append({
                    "index": i * self.n + c.index,
                    "text": prefix + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })  # fmt: skip
        return self.envelope(choices, outs)


class ChatView(View):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, serving, parsed, rid, rules: OutputRules):
        super().__init__(serving, parsed, rid)
        self.rules = rules  # reasoning / content / tool calls (chat_output.py)

    def delta(self, i, out, c, st):
        d: dict[str, Any] = {}
        if not st.started:
            st.started = True
            d["role"] = self.s.response_role
            d["content"] = ""
            st.stream = self.rules.stream()
        final = c.finish_reason is not None
        visible = c.text if final else c.text[: max(len(c.text) - self.hold, 0)]
        d.update(st.stream.delta(visible, final))
        finish_reason = st.stream.finish_reason(c.finish_reason)
        lp = None
        if self.p.logprobs is not None and c.logprobs is not None:
            lp = {"content": chat_logprobs(c, st.tokens, len(c.logprobs), self.p.logprobs)}
            st.tokens = len(c.logprobs)
        if c.finish_reason is not None:
            st.finished = True
        if not d and c.finish_reason is None and not (lp and lp["content"]):
            return None
        return {
            "index": c.index,
            "delta": d,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }

    def full(self, outs):
        (out,) = outs
        choices = []
        for c in out.outputs:
            lp = None
            if self.p.logprobs is not None and c.logprobs is not None:
                lp = {"content": chat_logprobs(c, 0, len(c.logprobs), self.p.logprobs)}
            message, finish_reason = self.rules.message(self.s.response_role, c.text,
                                                        c.finish_reason)  # fmt: skip
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })  # fmt: skip
        return self.envelope(choices, outs)


# ----------------------------------------------------------------- logprobs


def completion_logprobs(c: CompletionOutput, lo: int, hi: int, offset: int) -> dict:
    """OpenAI completions logprobs for output positions [lo, hi): tokens, token_logprobs,
    top_logprobs (the top-k and the sampled token, by decoded text), text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    assert c.logprobs is not None
    for j in range(lo, hi):
        entry = c.logprobs[j]
        tid = c.token_ids[j]
        chosen = entry[tid]
        s = chosen.decoded_token or ""
        tokens.append(s)
        token_lps.append(chosen.logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(c: CompletionOutput, lo: int, hi: int, k: int) -> list[dict]:
    """OpenAI chat logprobs entries for output positions [lo, hi)."""
    assert c.logprobs is not None
    out = []
    for j in range(lo, hi):
        entry = c.logprobs[j]
        chosen = entry[c.token_ids[j]]
        tops = sorted(
            (lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
            key=lambda lp: lp.rank,
        )
        out.append({
            "token": chosen.decoded_token or "",
            "logprob": chosen.logprob,
            "bytes": list((chosen.decoded_token or "").encode("utf-8")),
            "top_logprobs": [
                {"token": t.decoded_token or "", "logprob": t.logprob,
                 "bytes": list((t.decoded_token or "").encode("utf-8"))}
                for t in tops
            ],
        })  # fmt: skip
    return out


# ----------------------------------------------------------------- chat templates
