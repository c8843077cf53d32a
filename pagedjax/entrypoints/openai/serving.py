"""The OpenAI endpoints' logic: prompts in, RequestOutputs out as OpenAI JSON or SSE.

Handlers tokenize and check a request on the event loop (so a bad request is answered
before it reaches the engine), then read the engine's cumulative RequestOutputs and
turn them into OpenAI's response or into ``data: {...}`` chunks ending with
``data: [DONE]`` (views.py: one view per endpoint).

A client that goes away cancels the handler (``run_until_disconnect`` while a request
waits for its first output or, not streamed, for its last; Starlette's disconnect
listener once a stream has started); the generator's ``finally`` then aborts the request,
which frees its blocks before the engine's next step. Limits (``limits.py``) are checked
before validation; errors map to OpenAI's shape through one table (``limits.error_for``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedjax.engine.outputs import RequestOutput
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai.chat_output import build_rules, prepare_chat
from pagedjax.entrypoints.openai.limits import ServerLimits, check_body, error_for, with_deadline
from pagedjax.entrypoints.openai.lora_adapters import LoRAAdapters
from pagedjax.entrypoints.openai.media import MediaFetchPolicy
from pagedjax.entrypoints.openai.protocol import (
    OpenAIError,
    ParsedRequest,
    bad,
    parse_chat,
    parse_completion,
)
from pagedjax.entrypoints.openai.structured import parse_constraints
from pagedjax.entrypoints.openai.tool_tags import strict_tool_calling
from pagedjax.entrypoints.openai.views import ChatView, CompletionView
from pagedjax.model.vision.preprocess import load_image


class OpenAIServing:
    """Completions and chat completions over one AsyncLLMEngine (whatever its engine:
    every engine fact used here is ``EngineClient``'s, pagedjax/engine/protocol.py)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: list[str],
        *,
        chat_template: str | None = None,
        response_role: str = "assistant",
        limits: ServerLimits | None = None,
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        lora_modules: dict[str, Any] | None = None,
        allow_runtime_lora_updating: bool | None = None,
        image_prompt: tuple[str, int] | None = None,
        media: MediaFetchPolicy | None = None,
    ):
        # (placeholder text, image tokens per image) of a multi-modal model, else None.
        self.image_prompt = image_prompt
        self.media = media or MediaFetchPolicy.from_env()  # image URLs to fetch (media.py)
        self.enable_auto_tools, self.tool_parser = enable_auto_tools, tool_parser
        # vLLM's VLLM_ENFORCE_STRICT_TOOL_CALLING, read once as vLLM does (tool_tags.py).
        self.strict_tools = strict_tool_calling()
        # LoRA adapters served by name ("model": name), static and loaded at run time
        # (lora_adapters.py, docs/lora.md).
        self.loras = LoRAAdapters(engine, served_model_names, lora_modules,
                                  allow_runtime_lora_updating)  # fmt: skip
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.names = served_model_names
        self.chat_template = chat_template
        self.response_role = response_role
        self.tokenizer = engine.tokenizer

    # ------------------------------------------------------------- shared

    def check_model(self, name: str | None) -> Any:
        """The request's adapter (a LoRARequest) when ``name`` is a LoRA module's, None for
        the base model's names (or no name); 404 as vLLM for any other name."""
        lora = self.loras.get(name)
        if lora is not None:
            return lora
        if name is not None and name not in self.names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")
        return None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, template: str | None,
                    template_kwargs: dict | None = None):  # fmt: skip
        """The conversation as prompt text: the request's or the server's template, else
        the tokenizer's; a 400 when there is none. template_kwargs: ``tools=`` and the
        request's chat_template_kwargs."""
        template = template or self.chat_template
        tok = self.tokenizer
        own = getattr(tok, "chat_template", None)
        if template is None and own is None:
            raise bad(
                "this model's tokenizer has no chat template and the server was started"
                " without --chat-template; use /v1/completions or give a template",
                "messages",
            )
        try:
            if hasattr(tok, "apply_chat_template"):
                return tok.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, chat_template=template,
                    **(template_kwargs or {}),
                )  # fmt: skip
            return render_template(template, messages, add_generation_prompt, tok,
                                   **(template_kwargs or {}))  # fmt: skip
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's
            raise bad(f"chat template failed: {type(e).__name__}: {e}", "messages") from e

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return prompt

    def _max_tokens(self, parsed: ParsedRequest, plen: int, where: str) -> int:
        limit = self.engine.max_model_len
        if plen >= limit:
            raise bad(
                f"This model's maximum context length is {limit} tokens. However, your"
                f" {where} has {plen} tokens, leaving no room for a completion. Please reduce"
                f" the length of the {where}.",
                "messages" if where == "messages" else "prompt",
            )
        mt = parsed.max_tokens
        if mt is None:
            return limit - plen
        if plen + mt > limit:
            raise bad(
                f"This model's maximum context length is {limit} tokens. However, you"
                f" requested {plen + mt} tokens ({plen} in the {where}, {mt} in the"
                f" completion). Please reduce the length of the {where} or completion.",
                "max_tokens",
            )
        return mt

    # ------------------------------------------------------------- completions

    async def completions(self, body: Any, request: Request) -> Response:
        e = self.engine
        check_body(body, self.limits)
        parsed = parse_completion(body, vocab_size=e.vocab_size, max_logprobs=e.max_logprobs)
        lora = self.check_model(parsed.model)
        parsed.params_kwargs.update(parse_constraints(body, e.vocab_size))
        jobs = []
        for p in parsed.prompts:
            ids = self.tokenize(p, parsed.add_special_tokens)
            mt = self._max_tokens(parsed, len(ids), "prompt")
            text = p if isinstance(p, str) else None
            jobs.append(({"prompt_token_ids": ids, "prompt": text}, parsed.sampling_params(mt)))
        rid = f"cmpl-{uuid.uuid4().hex}"
        view = CompletionView(self, parsed, rid)
        return await self._respond(parsed, jobs, rid, view, request, lora)

    # ------------------------------------------------------------- chat

    async def chat(self, body: Any, request: Request) -> Response:
        e = self.engine
        check_body(body, self.limits)
        parsed = parse_chat(body, vocab_size=e.vocab_size, max_logprobs=e.max_logprobs)
        lora = self.check_model(parsed.model)
        assert parsed.messages is not None
        parsed.params_kwargs.update(parse_constraints(body, e.vocab_size))
        extras = prepare_chat(body, parsed, auto_tools=self.enable_auto_tools and
                              self.tool_parser is not None, tool_parser=self.tool_parser,
                              strict_tools=self.strict_tools)  # fmt: skip
        images = await self._chat_images(parsed.messages)
        text = self.render_chat(
            parsed.messages, parsed.add_generation_prompt, parsed.chat_template,
            extras.template_kwargs,
        )  # fmt: skip
        rules = build_rules(extras, tool_parser=self.tool_parser,
                            reasoning_parser=self.reasoning_parser, prompt=text)  # fmt: skip
        ids = self.tokenize(text, parsed.add_special_tokens)
        # Each placeholder becomes the image's tokens in the engine (multimodal.py).
        extra = len(images) * (self.image_prompt[1] - 1) if images else 0
        mt = self._max_tokens(parsed, len(ids) + extra, "messages")
        prompt: dict = {"prompt_token_ids": ids, "prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        jobs = [(prompt, parsed.sampling_params(mt))]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        view = ChatView(self, parsed, rid, rules)
        return await self._respond(parsed, jobs, rid, view, request, lora)

    async def _chat_images(self, messages: list[dict]) -> list[bytes]:
        """The messages' images in order (protocol.parse_messages kept data: URLs as bytes
        and other URLs to fetch, under the media policy: media.py), each message's
        content then led by one placeholder per image (vLLM's placement for a chat
        template over string content). 400 for images to a text-only model, a URL the
        policy refuses or cannot fetch, or bytes that do not decode as an image."""
        images: list[bytes] = []
        for m in messages:
            found = m.pop("images", None)
            if not found:
                continue
            if self.image_prompt is None:
                raise bad("this model takes no images (image_url content parts)", "messages")
            found = [x if isinstance(x, bytes) else await self.media.fetch(x) for x in found]
            for data in found:
                try:
                    load_image(data)
                except ValueError as e:
                    raise bad(f"image_url: {e}", "messages") from None
            m["content"] = "\n".join([self.image_prompt[0]] * len(found) +
                                     ([m["content"]] if m["content"] else []))  # fmt: skip
            images.extend(found)
        return images

    # ------------------------------------------------------------- engine I/O

    async def _respond(self, parsed, jobs, rid, view, request: Request,
                       lora: Any = None) -> Response:  # fmt: skip
        n_prompts = len(jobs)
        gens = [
            self.engine.generate(prompt, params, f"{rid}-{i}", lora_request=lora)
            for i, (prompt, params) in enumerate(jobs)
        ]
        stream = _merged(gens) if n_prompts > 1 else _single(gens[0])
        stream = with_deadline(stream, self.limits.request_timeout_s)
        if parsed.stream:
            try:  # add errors become HTTP errors, not SSE; a client gone meanwhile aborts
                first = await run_until_disconnect(request, _first(stream))
            except BaseException:
                await stream.aclose()
                raise
            return StreamingResponse(
                view.sse(first, stream, n_prompts), media_type="text/event-stream"
            )

        async def collect() -> list[RequestOutput]:
            last: dict[int, RequestOutput] = {}
            try:
                async for i, out in stream:
                    last[i] = out
            finally:
                await stream.aclose()
            return [last[i] for i in range(n_prompts)]

        outs = await run_until_disconnect(request, collect())
        return JSONResponse(view.full(outs))


async def _first(stream: AsyncIterator) -> Any:
    try:
        return await stream.__anext__()
    except Exception as e:  # noqa: BLE001 - limits.error_for's table
        raise error_for(e) from e


async def _single(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for out in gen:
            yield 0, out
    finally:
        await gen.aclose()  # aborts the request if it did not finish


async def _merged(gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the prompt index; an error
    in any cancels (and so aborts) the others."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                q.put_nowait((i, out))
            q.put_nowait(done)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    left = len(tasks)
    try:
        while left:
            item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnect(request: Request, coro) -> Any:
    """Await coro; if the client disconnects first, cancel it (which aborts its requests)
    and answer 499 (nobody reads it)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled (shutdown)
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise OpenAIError(499, "client disconnected")
    try:
        return task.result()
    except Exception as e:  # noqa: BLE001 - limits.error_for's table
        raise error_for(e) from e


# ----------------------------------------------------------------- response views


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path or the template text itself."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if "{" not in value:
        raise SystemExit(f"error: --chat-template {value!r} is neither a file nor a template")
    return value


def render_template(template: str, messages: list[dict], add_generation_prompt: bool, tok,
                    **template_kwargs: Any) -> str:  # fmt: skip
    """Render a Jinja chat template as transformers does (sandboxed, trim_blocks), for
    tokenizers without their own renderer (the byte-level fallback)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="",
        eos_token="",
        **template_kwargs,
    )
