"""The FastAPI app: routes, error mapping, and the engine bridge's lifetime.

    build_app(engine, config) -> FastAPI, Guard middleware outermost  (app.state: engine, bridge, metrics)
        POST /v1/completions         serving.completions
        POST /v1/chat/completions    serving.chat
        GET  /v1/models              the served model
        GET  /health                 200; 503 while draining or after an engine failure (no key needed)
        GET  /metrics                Prometheus text format (no key needed)
    lifespan: start the engine thread on start-up, stop it (aborting leftovers) on shutdown

Errors: ApiError -> its status; AdmissionError -> 429 / 503 with Retry-After; unknown routes 404 and
wrong methods 405, all as OpenAI-style bodies; any other exception -> 500 (the engine keeps serving).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.config import EngineConfig
from jaxserve.engine_client import EngineClient
from jaxserve.server import protocol as P
from jaxserve.server.bridge import AdmissionError, EngineBridge
from jaxserve.server.errors import ApiError, error_body
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.middleware import Guard
from jaxserve.server.serving import Serving

logger = logging.getLogger(__name__)


def served_model_name(config: EngineConfig) -> str:
    return config.server.served_model_name or Path(config.model.path).name


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param), status_code=status, media_type="application/json",
                    headers=headers)


def build_app(engine: EngineClient, config: EngineConfig) -> FastAPI:
    server_config = config.server
    model_name = served_model_name(config)
    metrics = ServerMetrics(model_name)
    bridge = EngineBridge(engine, metrics, server_config.max_queued_requests)
    serving = Serving(engine, bridge, server_config, model_name)
    retry_after = {"Retry-After": str(server_config.retry_after_s)}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        bridge.start()
        try:
            yield
        finally:
            bridge.stop()
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

    @app.get("/v1/models")
    async def models() -> Response:
        card = P.ModelCard(id=model_name, created=serving.created, max_model_len=engine.max_model_len)
        return Response(P.ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if bridge.dead is not None:
            return _error(503, f"the engine failed: {bridge.dead!r}")
        if bridge.draining:
            return _error(503, "the server is draining before shutdown", headers=retry_after)
        return JSONResponse({})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Guard, config=server_config)
    return app
