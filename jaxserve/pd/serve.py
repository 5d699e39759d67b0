"""A PD instance's additions to the OpenAI server: GET /pd/info and the transfer gauges in /metrics.

    GET /pd/info  {"role", "kv_transfer_address" (decode: where prefill instances send KV), "block_size",
                   "kv_layout" (what a block's bytes mean; a sender's must be equal), "num_free_blocks",
                   "open_transfers", "outcomes": {outcome: count}, decode: "steps" (its latest steps' times and
                   how many of the slowest were at or just after a block install or during a pull:
                   step_log.DecodeStepLog.summary)} (behind the API key)
    /metrics      jaxserve:pd_free_blocks, jaxserve:pd_open_transfers, jaxserve:pd_transfers{outcome}

The engine is a PDEngine (engine thread in this process: its info() is read here) or a ProcessEngineClient
of one (jaxserve/engine_process.py: info() asks the engine process; the gauges are its latest step's).
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI
from prometheus_client import Gauge
from starlette.responses import JSONResponse

from jaxserve.server.metrics import PREFIX


def attach(app: FastAPI, engine: Any) -> None:
    """Adds the route and the gauges."""
    metrics = app.state.metrics
    free = Gauge(PREFIX + "pd_free_blocks", "Free KV blocks (cached ones included) of this PD instance.",
                 registry=metrics.registry)
    open_transfers = Gauge(PREFIX + "pd_open_transfers", "KV transfers not yet resolved (decode: reservations "
                           "held; prefill: transfers in flight).", registry=metrics.registry)
    outcomes = Gauge(PREFIX + "pd_transfers", "KV transfers by outcome since start.", ["outcome"],
                     registry=metrics.registry)
    render = metrics.render

    def render_with_pd() -> bytes:
        free.set(engine.num_free_blocks)
        open_transfers.set(engine.num_open_transfers)
        for outcome, count in list(engine.counts.items()):
            outcomes.labels(outcome).set(count)
        return render()

    metrics.render = render_with_pd

    @app.get("/pd/info")
    async def pd_info() -> JSONResponse:
        body = engine.info()
        return JSONResponse(await body if inspect.isawaitable(body) else body)
