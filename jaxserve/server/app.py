"""The FastAPI app: routes, error mapping, and the engine bridge's lifetime.

    build_app(engine, config) -> FastAPI, Guard middleware outermost  (app.state: engine, bridge, metrics)
        POST /v1/completions         serving.completions
        POST /v1/chat/completions    serving.chat
        POST /tokenize, /detokenize  serving.tokenize / detokenize (vLLM's shapes)
        GET  /v1/models              the served model (vLLM's card); /v1/models/{id}: it, or 404
        GET|HEAD /health             200; 503 while draining, after an engine failure, or while no tokenizer
                                     worker runs (no key needed)
        GET|POST /ping               the same as /health (no key needed)
        GET  /version                {"version": jaxserve's} (no key needed)
        GET  /metrics                Prometheus text format (no key needed)
    lifespan: start the tokenizer workers and the engine thread on start-up; on shutdown stop the engine
    thread (aborting leftovers), then the workers

Errors: ApiError -> its status; AdmissionError -> 429 / 503 with Retry-After; unknown routes 404 and
wrong methods 405, all as OpenAI-style bodies; any other exception -> 500 (the engine keeps serving).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import uuid
from pathlib import Path

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.config import EngineConfig
from jaxserve.engine_client import EngineClient
from jaxserve.server import protocol as P
from jaxserve.server.bridge import AdmissionError, for_engine
from jaxserve.server.errors import ApiError, error_body
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.middleware import Guard
from jaxserve.server.serving import Serving
from jaxserve.server.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)


def served_model_name(config: EngineConfig) -> str:
    return config.server.served_model_name or Path(config.model.path).name


def jaxserve_version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param), status_code=status, media_type="application/json",
                    headers=headers)


def build_app(engine: EngineClient, config: EngineConfig) -> FastAPI:
    server_config = config.server
    model_name = served_model_name(config)
    metrics = ServerMetrics(model_name)
    bridge = for_engine(engine, metrics, server_config.max_queued_requests)
    tokens = (None if engine.tokenizer is None else
              TokenizerPool(config.model.tokenizer or config.model.path, engine.max_model_len,
                            server_config.tokenizer_workers, server_config.tokenizer_timeout_s))
    serving = Serving(engine, bridge, server_config, model_name, tokens)
    retry_after = {"Retry-After": str(server_config.retry_after_s)}
    card = P.ModelCard(id=model_name, created=serving.created, root=str(config.model.path),
                       max_model_len=engine.max_model_len,
                       permission=[P.ModelPermission(id=f"modelperm-{uuid.uuid4().hex}", created=serving.created)])

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if tokens is not None:
            await tokens.start()
        bridge.start()
        try:
            yield
        finally:
            bridge.stop()
            engine.close()  # (the bridge has stopped: nothing steps the engine any more)
            if tokens is not None:
                await tokens.close()
            serving.close()

    app = FastAPI(title="jaxserve", lifespan=lifespan)
    app.state.engine, app.state.bridge, app.state.metrics, app.state.serving = engine, bridge, metrics, serving

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> Response:
        return _error(err.status, err.message, err.param, err.headers)

    @app.exception_handler(AdmissionError)
    async def admission_error(_request: Request, err: AdmissionError) -> Response:
        return _error(err.status, str(err), headers=retry_after)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, err: HTTPException) -> Response:
        return _error(err.status_code, str(err.detail), headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception) -> Response:
        logger.exception("request failed")
        return _error(500, f"internal server error: {type(err).__name__}: {err}")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving.detokenize(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(P.ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != model_name:
            return _error(404, f"The model `{model_id}` does not exist.", "model")
        return Response(card.model_dump_json(), media_type="application/json")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if bridge.dead is not None:
            return _error(503, f"the engine failed: {bridge.dead!r}")
        if bridge.draining:
            return _error(503, "the server is draining before shutdown", headers=retry_after)
        if tokens is not None and not tokens.available:
            return _error(503, "no tokenizer worker is running (the server log says why)", headers=retry_after)
        return JSONResponse({})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": jaxserve_version()})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Guard, config=server_config)
    return app
