"""OpenAI-compatible HTTP serving: `jaxserve serve --config configs/x.yaml`.

    client --HTTP--> uvicorn (connections.py: keep-alive and read timeouts)
        --> middleware.Guard (head size, API key on the raw path, tenant, body size)
        --> app.py routes --> serving.py (validate, volume caps)
        --> tokenizer_pool.py: chat templates and tokenization in worker processes (tokenizer_worker.py)
        --> bridge.ProcessBridge.submit (admission: 429 full, 503 draining) --frames--> the engine process
        (jaxserve/engine_process.py); its step frames --reader thread, call_soon_threadsafe--> per-request
        asyncio queues (server.engine_process false: bridge.EngineBridge and an engine thread instead)
        --> serving.py: JSON response, or streaming.py's SSE chunks ending in `data: [DONE]`
    metrics.py: Prometheus collectors fed by the bridge after each step; `GET /metrics`.

Only this package and jaxserve/bench/serve.py import fastapi, uvicorn, pydantic or prometheus_client.
"""
