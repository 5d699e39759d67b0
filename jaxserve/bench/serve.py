"""`jaxserve bench serve`: an async client against a running OpenAI-compatible server (vLLM's `bench serve`).

    prompts (--dataset-name random: token ids of --random-input-len, or file: JSON lines; prompts.py,
             shared with `bench throughput`: the same --seed, lengths and tokenizer give the same
             requests, and both reports carry their prompts_fingerprint)
    --> arrival times: Poisson at --request-rate (gamma with --burstiness; inf = all at once),
        at most --max-concurrency open at a time
    --> one streaming request each (/v1/completions or /v1/chat/completions), timed per SSE chunk
    --> TTFT, TPOT, ITL, E2EL (mean, median, --metric-percentiles), throughput, goodput
        (--goodput ttft:MS tpot:MS e2el:MS: requests meeting every SLO, per second), --output-json

Definitions (as vLLM): TTFT = send -> first chunk with content; E2EL = send -> last chunk;
TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = the gaps between successive content chunks (a chunk may
carry several tokens when the client reads slower than the engine steps).
Output and input token counts come from the server's usage (stream_options.include_usage).
A stream that ends without text fails its request, saying why (no_text_error): a server without a
tokenizer streams token counts but no text, so it cannot be timed; serve a dummy-weights model with a
synthetic tokenizer instead (configs/llama3-8b-dummy-serve.yaml).
No JAX here: the tokenizer (for random prompts' vocabulary and chat text) is jaxserve.tokenizer.

    jaxserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20 --goodput ttft:200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from jaxserve.bench import prompts
from jaxserve.config import DEFAULT_MODEL
from jaxserve.tokenizer import Tokenizer

METRICS = ("ttft", "tpot", "itl", "e2el")
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclasses.dataclass
class Prompt:
    body: dict[str, Any]  # "prompt" or "messages"
    max_tokens: int


@dataclasses.dataclass
class Result:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    e2el: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    text: str = ""  # the streamed text

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 and self.ttft else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxserve bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=tuple(ENDPOINTS), default="openai")
    parser.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (else --host and --port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", help="default: /v1/completions, or /v1/chat/completions for openai-chat")
    parser.add_argument("--model", help="the `model` field to send (default: the server's only model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer key (default: $OPENAI_API_KEY)")
    parser.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                        help="extra request header, e.g. X-Tenant-Id=team-a (repeatable)")
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL, help="tokenizer dir (default: the embedded model)")
    parser.add_argument("--dataset-name", choices=("random", "file"), default="random")
    parser.add_argument("--dataset-path", type=Path,
                        help="JSON lines: {'prompt': str} or {'prompt_token_ids': [...]}, optional 'output_len' "
                             "(or 'max_tokens'); repeated in order up to --num-prompts")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=8, help="prompt tokens (the embedded model has 32 "
                                                                          "positions in all)")
    parser.add_argument("--random-output-len", type=int, default=16)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)]")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, help="requests open at once at most")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:200 tpot:50")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output-json", type=Path, help="write the full result (per-request values included)")
    parser.add_argument("--disable-tqdm", action="store_true")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[dict[str, float], list[str], list[float]]:
    """The goodput SLOs (seconds), the metrics and percentiles to report; ValueError names a bad flag."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0 (--request-rate inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.dataset_name == "file" and args.dataset_path is None:
        raise ValueError("--dataset-name file needs --dataset-path")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if bad := [m for m in metrics if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {list(METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers like 50,90,99, "
                         f"got {args.metric_percentiles!r}") from None
    slos = {}
    for item in args.goodput:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value.replace(".", "", 1).isdigit():
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value) / 1e3
    return slos, metrics, percentiles


def make_prompts(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list[Prompt], str]:
    """The requests (prompts.py: as `bench throughput` makes them) and their fingerprint. A file shorter
    than --num-prompts is repeated in order."""
    if args.dataset_name == "file":
        requests = prompts.read_requests(args.dataset_path, args.random_output_len)
        requests = [requests[i % len(requests)] for i in range(args.num_prompts)]
    else:
        requests = prompts.random_requests(args.seed, args.num_prompts, args.random_input_len,
                                           args.random_output_len, args.random_range_ratio, tokenizer.vocab_size,
                                           tokenizer.all_special_ids)
    chat = args.backend == "openai-chat"
    bodies = []
    for request in requests:
        prompt = request.prompt
        if chat and not isinstance(prompt, str):
            prompt = tokenizer.decode(prompt, skip_special_tokens=True)
        bodies.append(Prompt(_body(prompt, chat), request.output_len))
    return bodies, prompts.fingerprint(requests)


def _body(prompt: str | list[int], chat: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}


async def send(client: httpx.AsyncClient, endpoint: str, prompt: Prompt, args: argparse.Namespace) -> Result:
    body = {**prompt.body, "max_tokens": prompt.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos,
            "skip_special_tokens": False}  # every token shows in the text, so each one is timed
    if args.model:
        body["model"] = args.model
    result = Result()
    finish_reason = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                finish_reason = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")),
                                     finish_reason)
                text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in chunk["choices"])
                if text:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.text += text
        result.e2el = time.perf_counter() - start
        result.success = result.ttft is not None
        result.error = "" if result.success else no_text_error(result.output_tokens, finish_reason)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


def no_text_error(output_tokens: int, finish_reason: str | None) -> str:
    """Why a stream that ended without any text cannot be timed (TTFT and ITL are taken on text chunks)."""
    if output_tokens == 0:
        return f"the stream carried no text and no token count (finish_reason {finish_reason!r})"
    if finish_reason == "stop":
        return (f"the request stopped after {output_tokens} token(s) that decode to no text (an eos or stop "
                "token); --ignore-eos generates max_tokens")
    return (f"the server streamed {output_tokens} token(s) but no text: it runs without a tokenizer "
            "(model.skip_tokenizer_init), and TTFT and ITL are timed on text chunks; serve the model with a "
            "tokenizer (for dummy weights: configs/llama3-8b-dummy-serve.yaml and "
            "benchmarks/make_synthetic_tokenizer.py)")


async def run(args: argparse.Namespace, prompts: list[Prompt], base_url: str) -> tuple[list[Result], float]:
    headers = dict(h.split("=", 1) for h in args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    endpoint = args.endpoint or ENDPOINTS[args.backend]
    limit = args.max_concurrency or len(prompts)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        probe = await send(client, endpoint, dataclasses.replace(prompts[0], max_tokens=1), args)
        if not probe.success:
            raise ValueError(f"the test request to {base_url}{endpoint} failed: {probe.error}")
        rng = np.random.default_rng(args.seed + 1)
        gaps = (np.zeros(len(prompts)) if np.isinf(args.request_rate) else
                rng.gamma(args.burstiness, 1.0 / (args.request_rate * args.burstiness), len(prompts)))
        semaphore = asyncio.Semaphore(limit)
        bar = tqdm(total=len(prompts), desc="requests", disable=args.disable_tqdm)

        async def limited(prompt: Prompt) -> Result:
            async with semaphore:
                result = await send(client, endpoint, prompt, args)
            bar.update()
            return result

        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        bar.close()
        return results, time.perf_counter() - start


def report(args: argparse.Namespace, results: list[Result], duration: float, slos: dict[str, float],
           metrics: list[str], percentiles: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [gap for r in ok for gap in r.itl], "e2el": [r.e2el for r in ok]}
    good = [r for r in ok if all((getattr(r, name) or 0.0) <= slo for name, slo in slos.items())]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_rate": args.request_rate if np.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "request_goodput": len(good) / duration if slos else None,
        "goodput_slos_ms": {name: slo * 1e3 for name, slo in slos.items()},
    }
    for name in metrics:
        data = np.asarray(values[name], np.float64) * 1e3
        summary[f"mean_{name}_ms"] = float(data.mean()) if data.size else None
        summary[f"median_{name}_ms"] = float(np.median(data)) if data.size else None
        for q in percentiles:
            summary[f"p{q:g}_{name}_ms"] = float(np.percentile(data, q)) if data.size else None
    return summary


def print_summary(summary: dict[str, Any], metrics: list[str], percentiles: list[float], errors: list[str]) -> None:
    def line(label: str, value) -> None:
        shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{shown:>10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    line("Successful requests:", summary["completed"])
    line("Failed requests:", summary["failed"])
    line("Maximum request concurrency:", summary["max_concurrency"])
    line("Request rate configured (RPS):", summary["request_rate"])
    line("Benchmark duration (s):", summary["duration_s"])
    line("Total input tokens:", summary["total_input_tokens"])
    line("Total generated tokens:", summary["total_output_tokens"])
    line("Prompts fingerprint:", summary["prompts_fingerprint"])
    line("Request throughput (req/s):", summary["request_throughput"])
    if summary["request_goodput"] is not None:
        line("Request goodput (req/s):", summary["request_goodput"])
    line("Output token throughput (tok/s):", summary["output_throughput"])
    line("Total token throughput (tok/s):", summary["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in metrics:
        print("{s:{c}^50}".format(s=f" {titles[name]} ", c="-"))
        line(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"])
        line(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"])
        for q in percentiles:
            line(f"P{q:g} {name.upper()} (ms):", summary[f"p{q:g}_{name}_ms"])
    print("=" * 50)
    for error in errors[:5]:
        print(f"failed: {error}", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        slos, metrics, percentiles = check_args(args)
        if bad := [h for h in args.header if "=" not in h]:
            raise ValueError(f"--header takes NAME=VALUE, got {bad}")
        tokenizer = Tokenizer.from_dir(args.tokenizer)
        requests, fingerprint = make_prompts(args, tokenizer)
        base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        results, duration = asyncio.run(run(args, requests, base_url))
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {"prompts_fingerprint": fingerprint, **report(args, results, duration, slos, metrics, percentiles)}
    print_summary(summary, metrics, percentiles, [r.error for r in results if not r.success])
    if args.output_json is not None:
        per_request = {"input_lens": [r.prompt_tokens for r in results],
                       "output_lens": [r.output_tokens for r in results],
                       "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                       "e2els": [r.e2el for r in results], "errors": [r.error for r in results],
                       "generated_texts": [r.text for r in results]}
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items() if k != "api_key"},
                                                **summary, **per_request}, indent=2) + "\n")
        print(f"wrote {args.output_json}")
    return 0 if summary["completed"] else 1
