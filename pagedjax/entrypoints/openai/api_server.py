"""vLLM's OpenAI-compatible server for pagedjax, on FastAPI + uvicorn.

    python -m pagedjax.entrypoints.openai.api_server --model DIR_OR_PRESET --port 8000
    pagedjax serve DIR_OR_PRESET --port 8000            # the same flags

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
/v1/load_lora_adapter, /v1/unload_lora_adapter (lora_adapters.py); GET
/v1/models, /health, /version, /metrics. ``build_app(engine, ...)`` makes the app over
an AsyncLLMEngine (tests run it in-process); ``run_server(args)`` loads the model and
serves until interrupted. docs/serving.md gives the design and the measurements.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pagedjax.engine.protocol import EngineClient
from pagedjax.entrypoints.async_engine import AsyncLLMEngine
from pagedjax.entrypoints.openai import cli_args
from pagedjax.entrypoints.openai.limits import LimitError, ServerLimits, check_body, read_json
from pagedjax.entrypoints.openai.media import MediaFetchPolicy
from pagedjax.entrypoints.openai.metrics import ServerMetrics
from pagedjax.entrypoints.openai.protocol import JsonFields, OpenAIError, bad, parse_messages
from pagedjax.entrypoints.openai.serving import OpenAIServing, load_chat_template
from pagedjax.entrypoints.openai.shutdown import Drainer, DrainingServer, DrainMiddleware

log = logging.getLogger("pagedjax.server")

# With --disable-frontend-multiprocessing the engine thread and the event loop share one
# interpreter (the default: the engine core steps in its own process). With CPython's default
# 5 ms GIL switch interval, each time the engine thread comes back from a device call
# while the loop is busy encoding chunks it can wait up to 5 ms for the GIL, many times
# per step; 0.5 ms cut that convoy (server / offline throughput 0.46 -> 0.83 in one
# measurement, docs/serving.md). Set by run_server for the whole process.
SERVER_SWITCH_INTERVAL_S = 0.0005


def version() -> str:
    try:
        return metadata.version("pagedjax")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=getattr(e, "headers", None))


# vLLM 0.32's --api-key guards these path prefixes (docs/security.md).
API_KEY_PREFIXES = ("/v1", "/v2", "/inference")


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str],
    *,
    model_path: str | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    response_role: str = "assistant",
    metrics: ServerMetrics | None = None,
    limits: ServerLimits | None = None,
    shutdown_timeout_s: float = 20.0,
    lora_modules: dict[str, Any] | None = None,
    allow_runtime_lora_updating: bool | None = None,
    media: MediaFetchPolicy | None = None,
    **output_parsers: Any,
) -> FastAPI:
    """The FastAPI app over ``engine``. Give ``metrics`` the ServerMetrics that is the
    engine's stats sink (else a fresh one without timings is made); ``limits`` the
    per-request limits (limits.py); ``shutdown_timeout_s`` the drain of a graceful
    shutdown (shutdown.py: ``app.state.drainer``). ``lora_modules``: {name: LoRARequest}
    of the adapters served by name (an engine with LoRA on; listed in /v1/models);
    ``allow_runtime_lora_updating``: /v1/load_lora_adapter and /v1/unload_lora_adapter
    on (None: the PAGEDJAX_ALLOW_RUNTIME_LORA_UPDATING variable, lora_adapters.py).
    ``media``: what chat image URLs may be fetched (media.py; None: the defaults, no
    local files). ``output_parsers``: OpenAIServing's enable_auto_tools, tool_parser,
    reasoning_parser."""
    app = FastAPI(title="pagedjax OpenAI-compatible server", version=version())
    metrics = metrics or ServerMetrics(served_model_names[0])
    limits = limits or ServerLimits()
    # A LLaVA or Idefics3 directory: chat image parts become its placeholder (None: refused).
    images = None
    if model_path:
        from pagedjax.engine.vision_models import image_prompt_info

        images = image_prompt_info(model_path, engine.tokenizer)
    serving = OpenAIServing(
        engine, served_model_names, chat_template=chat_template, response_role=response_role,
        limits=limits, lora_modules=lora_modules, image_prompt=images, media=media,
        allow_runtime_lora_updating=allow_runtime_lora_updating, **output_parsers,
    )  # fmt: skip
    drainer = Drainer(engine, shutdown_timeout_s, metrics)
    app.add_middleware(DrainMiddleware, drainer=drainer)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics
    app.state.drainer, app.state.limits = drainer, limits

    async def _json_body(request: Request) -> Any:
        return await read_json(request, limits)
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        if isinstance(e, LimitError) and e.reason is not None and e.status in (413, 503):
            metrics.rejected(e.reason)
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(OpenAIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return _error(OpenAIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith(API_KEY_PREFIXES):
            got = request.headers.get("authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return _error(OpenAIError(401, "invalid or missing API key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            err = engine.dead_error
            return _error(OpenAIError(503, str(err) if err else "engine is not running"))
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    @app.get("/v1/models")
    async def models() -> dict:
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedjax",
                "root": model_path or served_model_names[0],
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
            for name in served_model_names
        ]
        data += [  # vLLM's entries of LoRA modules: root = the adapter, parent = the base
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedjax",
                "root": lora.lora_path,
                "parent": lora.base_model_name or served_model_names[0],
                "max_model_len": engine.max_model_len,
            }
            for name, lora in serving.loras.modules.items()  # --lora-modules, then loaded
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return PlainTextResponse(await serving.loras.load(await _json_body(request)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return PlainTextResponse(await serving.loras.unload(await _json_body(request)))

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(
            await metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(await _json_body(request), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving.chat(await _json_body(request), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        fields = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
        body = await _json_body(request)
        check_body(body, limits)  # --max-messages: rendering runs on the event loop
        b = JsonFields(body, fields)
        serving.check_model(b.str("model"))
        if "messages" in b.body:
            text = serving.render_chat(
                parse_messages(b.body["messages"]), b.bool("add_generation_prompt", True), None
            )
            ids = serving.tokenize(text, b.bool("add_special_tokens", False))
        else:
            prompt = b.str("prompt")
            if prompt is None:
                raise bad("'prompt' (a string) or 'messages' is required", "prompt")
            ids = serving.tokenize(prompt, b.bool("add_special_tokens", True))
        b.warn_unknown("tokenize")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        b = JsonFields(await _json_body(request), {"model", "tokens"})
        serving.check_model(b.str("model"))
        tokens = b.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size
            for t in tokens
        ):
            raise bad(f"'tokens' must be an array of token ids in [0, {engine.vocab_size})",
                      "tokens")  # fmt: skip
        return {"prompt": serving.tokenizer.decode(tokens)}

    return app


def _core_config(args: argparse.Namespace) -> tuple[Any, int, Any]:
    """(EngineConfig, max_logprobs, NodeConfig or None) of an engine core, node 0's or a
    headless node's: the same function on every node, so their engines match.
    SystemExit naming what several nodes cannot run."""
    from pagedjax.engine.core_client import DEFAULT_MAX_LOGPROBS
    from pagedjax.engine.fronts.multinode import node_engine_config
    from pagedjax.entrypoints.llm import engine_config

    node = cli_args.node_config(args)
    kwargs = cli_args.llm_kwargs(args)
    max_logprobs = kwargs.pop("max_logprobs", DEFAULT_MAX_LOGPROBS)
    config = engine_config(**kwargs)
    if node is not None:
        try:
            config = node_engine_config(config, node)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    return config, max_logprobs, node


def build_engine_client(args: argparse.Namespace) -> EngineClient:
    """The engine the flags name: engine core processes (``MPEngineClient``, one per
    data-parallel replica; with --nnodes > 1 node 0's core, leading the headless nodes),
    or with --disable-frontend-multiprocessing the LLM's engine in this process (one
    thread steps it, replicas one after another)."""
    from pagedjax.entrypoints.llm import LLM

    if args.disable_frontend_multiprocessing:
        return LLM(**cli_args.llm_kwargs(args)).llm_engine
    from pagedjax.engine.core_client import MPEngineClient

    config, max_logprobs, node = _core_config(args)
    try:
        return MPEngineClient(config, max_logprobs=max_logprobs, node=node)
    except (RuntimeError, TimeoutError) as e:
        if node is None:
            raise
        # A node refused or missing (its configuration differs, it never connected):
        # the cause is the message, as for the headless side (run_headless).
        raise SystemExit(f"error: {e}") from None


def run_headless(args: argparse.Namespace) -> None:
    """A node other than 0 (``--headless --node-rank R``): no HTTP server; this process
    runs its share of the engine, following node 0, until node 0 stops (exit status 0)
    or dies (multinode.EXIT_LEADER_LOST)."""
    from pagedjax.engine.fronts.multinode import run_follower

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cli_args.reject_unbuilt(args)
    config, max_logprobs, node = _core_config(args)
    log.info("headless node %d of %d, node 0 at %s", node.node_rank, node.nnodes,
             node.coordinator)  # fmt: skip
    try:
        run_follower(config, node, max_logprobs)
    except RuntimeError as e:  # refused by node 0, or node 0 never answered
        raise SystemExit(f"error: {e}") from None


def build_from_args(args: argparse.Namespace) -> tuple[FastAPI, AsyncLLMEngine]:
    """Load the model named by the flags and build the app (and its engine)."""
    cli_args.reject_unbuilt(args)
    chat_template = load_chat_template(args.chat_template)
    names = args.served_model_name or [args.model]
    metrics = ServerMetrics(names[0])
    restarts = args.max_engine_restarts
    factory = None
    if restarts > 0 and not args.disable_frontend_multiprocessing:
        factory = lambda: build_engine_client(args)  # noqa: E731 - a dead core's successor
    engine = AsyncLLMEngine(
        build_engine_client(args), max_waiting_requests=args.max_waiting_requests,
        stats=metrics, engine_factory=factory, max_restarts=restarts,
    )  # fmt: skip
    try:  # --lora-modules: each adapter read once now, so a bad one stops the start
        lora_modules = cli_args.lora_requests(args, engine.engine, names)
        media = MediaFetchPolicy.from_env(args.allowed_local_media_path,
                                          args.allowed_media_domains)  # fmt: skip
    except ValueError as e:
        engine.shutdown()
        raise SystemExit(f"error: {e}") from None
    app = build_app(
        engine,
        names,
        lora_modules=lora_modules,
        model_path=args.model,
        api_key=args.api_key or os.environ.get("PAGEDJAX_API_KEY"),
        chat_template=chat_template,
        response_role=args.response_role,
        metrics=metrics,
        limits=ServerLimits.from_args(args),
        media=media,
        shutdown_timeout_s=args.shutdown_timeout,
        enable_auto_tools=args.enable_auto_tool_choice,
        tool_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    return app, engine


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGTERM / SIGINT, then drain (shutdown.py), log the final counters,
    stop the engine and return (exit status 0). With --headless: ``run_headless``."""
    import uvicorn

    if args.headless:
        run_headless(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    log.info("args: %s", cli_args.describe(args))
    app, engine = build_from_args(args)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_log_requests,
    )  # fmt: skip
    try:
        DrainingServer(config, app.state.drainer).run()
    finally:
        log.info("final counters: %s", app.state.metrics.summary())
        engine.shutdown()
        log.info("engine stopped")


def main(argv: list[str] | None = None) -> None:
    args = cli_args.make_parser().parse_args(argv)
    run_server(args)


if __name__ == "__main__":
    main(sys.argv[1:])
