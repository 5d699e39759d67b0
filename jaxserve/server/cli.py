"""`jaxserve serve [MODEL] [--config configs/x.yaml] [--host H] [--port P] [--api-key K] [--max-num-seqs N] ...`

    YAML config (default: jaxserve/configs/tiny.yaml, package data: the embedded model) --flags override
    any field of any section (`--max-num-seqs 8`, `--policy fair`, `--model DIR` for model.path), also by
    vLLM's names (`--tensor-parallel-size 2`; jaxserve/config_flags.py) --> EngineConfig
    (server.api_key set by neither: the JAXSERVE_API_KEY environment variable, invisible in `ps`)
    --> the engine (engine_process.build_engine: Engine, DataParallelEngine when parallel.data > 1, PDEngine
    for a PD role; it compiles its buckets), in its own process behind a ProcessEngineClient unless
    server.engine_process is false (or on multi-host process 0)
    --> build_app (which knows only the engine client interface) --> DrainingServer (uvicorn, h11 with
    connections.GuardedH11Protocol's timeouts)
    --> 0 on a clean exit
    parallel.process_id > 0 (multi-host): distributed.run_follower instead: no HTTP, follow process 0

JAX loads only when the engine is built, after the arguments were parsed and checked.

SIGTERM drains: new requests answer 503, in-flight ones finish (at most server.drain_timeout_s, then they
are aborted: streams end with finish_reason "abort"), then the process exits 0. A second SIGTERM, or
SIGINT, stops at once. Either way open connections get at most _SHUTDOWN_GRACE_S to close.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn
import yaml

from jaxserve import config_flags
from jaxserve.config import DEFAULT_CONFIG, EngineConfig, load_config
from jaxserve.server.app import build_app, served_model_name
from jaxserve.server.connections import GuardedH11Protocol

logger = logging.getLogger(__name__)

API_KEY_ENV = "JAXSERVE_API_KEY"  # as vLLM's VLLM_API_KEY: the key without it showing in the process list
_HEAD_SLACK = 8 << 10  # h11's hard limit on a request head: the request line on top of max_header_bytes
# Past the drain: how long aborted requests get to deliver their last output, and open connections to
# close (uvicorn's timeout_graceful_shutdown; then their tasks are cancelled).
_SHUTDOWN_GRACE_S = 3


class DrainingServer(uvicorn.Server):
    """uvicorn with a graceful SIGTERM: drain the bridge, then exit as if asked to (exit status 0)."""

    def __init__(self, config: uvicorn.Config, bridge, drain_timeout_s: float):
        super().__init__(config)
        self.bridge = bridge
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self._drain_started and self._loop is not None and not self.should_exit:
            # NOTE: not recorded as a captured signal, so uvicorn does not re-raise it at exit.
            self._drain_started = True
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        self.bridge.start_drain()
        logger.info("SIGTERM: draining %d in-flight requests (at most %.0f s)", self.bridge.num_in_flight,
                    self.drain_timeout_s)
        if not await self.bridge.wait_idle(self.drain_timeout_s):
            logger.warning("drain timeout: aborting %d requests", self.bridge.num_in_flight)
            self.bridge.abort_all()
            await self.bridge.wait_idle(_SHUTDOWN_GRACE_S)
        self.should_exit = True


def build_server(config: EngineConfig, engine, log_level: str = "info") -> DrainingServer:
    """The server for `engine` (built from `config`); `.run()` serves until shutdown."""
    app = build_app(engine, config)
    server = config.server
    uv_config = uvicorn.Config(app, host=server.host, port=server.port,
                               http=GuardedH11Protocol.with_read_timeout(server.read_timeout_s), lifespan="on",
                               log_level=log_level, access_log=server.access_log,
                               h11_max_incomplete_event_size=server.max_header_bytes + _HEAD_SLACK,
                               timeout_keep_alive=server.keep_alive_timeout_s,
                               timeout_graceful_shutdown=_SHUTDOWN_GRACE_S)
    return DrainingServer(uv_config, app.state.bridge, server.drain_timeout_s)


def _config_from_args(argv: list[str]) -> tuple[EngineConfig, str]:
    parser = argparse.ArgumentParser(prog="jaxserve serve", description="OpenAI-compatible server (README: Serving)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help=f"YAML config (default {DEFAULT_CONFIG.name})")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="the model's checkpoint directory, as `vllm serve MODEL` (the same as --model)")
    flags = config_flags.add_config_flags(parser, reserved={"--config", "--log-level"},
                                          repeatable={"server.api_key"})
    args = vars(parser.parse_args(argv))
    config = load_config(args.pop("config"))
    log_level = args.pop("log_level")
    model_tag = args.pop("model_tag")
    if model_tag is not None:
        if args.get("--model") not in (None, model_tag):
            raise ValueError(f"the model is given twice: {model_tag!r} and --model {args['--model']!r}; give one")
        args["--model"] = model_tag
    config = config.with_overrides(**config_flags.overrides(args, flags))
    if config.server.api_key is None and os.environ.get(API_KEY_ENV):  # the config or a flag wins
        config = config.with_overrides(api_key=os.environ[API_KEY_ENV])
    return config, log_level


def main(argv: list[str]) -> int:
    try:
        config, log_level = _config_from_args(argv)
        if config.server.pd_role == "decode":  # before the model loads: an open endpoint is refused at once
            from jaxserve.pd.protocol import check_bind

            check_bind(config.server.kv_transfer_address, config.server.kv_transfer_token)
    except (ValueError, TypeError, FileNotFoundError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if config.parallel.num_processes > 1 and config.parallel.process_id != 0:
        from jaxserve.distributed import run_follower  # JAX loads only once the arguments are known to be good

        logger.info("process %d follows process 0's steps", config.parallel.process_id)
        run_follower(config)
        return 0
    from jaxserve.engine_process import EngineProcessError, ProcessEngineClient, build_engine

    try:
        if config.server.engine_process and config.parallel.num_processes == 1:
            engine = ProcessEngineClient(config, log_level)  # the engine in its own process, built there
        else:
            engine = build_engine(config)
    except ValueError as err:  # a combination the engine refuses, named
        print(f"error: {err}", file=sys.stderr)
        return 2
    except EngineProcessError as err:  # the engine process failed to start (its log above says why)
        print(f"error: {err}", file=sys.stderr)
        return 1
    if config.scheduler.policy == "fcfs" and config.server.tenant_header:
        logger.info("scheduler.policy is fcfs: tenants are recorded but not scheduled fairly (set policy: fair)")
    if config.server.api_key and config.server.tenant_header:
        logger.info("server.api_key is set: the tenant is the API key; the %s header is ignored",
                    config.server.tenant_header)
    logger.info("serving %s on http://%s:%d", served_model_name(config), config.server.host, config.server.port)
    server = build_server(config, engine, log_level)
    if config.server.pd_role is not None:  # a prefill or decode instance behind `jaxserve router`
        from jaxserve.pd.serve import attach

        attach(server.config.app, engine)
    server.run()
    return 0
