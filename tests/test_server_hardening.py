"""`jaxserve serve` (its own process, so the server's GIL is its own) under input meant to stall it:
32 concurrent ~1 MB prompts, and prompts that really are tokenized, while a stream runs and /health is
polled (every gap under 100 ms); connections that sit idle or send half a request and stop.

The server's tokenizer is the embedded one with its <pad> token made 20,000 characters long: a token can
then cover 20,000 characters, so prompts up to 32 x 20,000 characters pass the length bound and are
tokenized (in the worker processes) before their token count refuses them.
"""

from __future__ import annotations

import gc
import json
import shutil
import socket
import threading
import time

import httpx
import pytest

from tests.conftest import TINY_MODEL
from tests.test_server_load import serve_process

LONG_TOKEN = "<" + "p" * 19_998 + ">"
KEEP_ALIVE_S, READ_TIMEOUT_S = 1.0, 0.5


@pytest.fixture(scope="module")
def long_token_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("long-token-tokenizer")
    spec = json.loads((TINY_MODEL / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["content"] == "<pad>":
            token["content"] = LONG_TOKEN
    spec["model"]["vocab"][LONG_TOKEN] = spec["model"]["vocab"].pop("<pad>")
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((TINY_MODEL / "tokenizer_config.json").read_text())
    config["pad_token"] = LONG_TOKEN
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TINY_MODEL / "generation_config.json", directory)
    return directory


@pytest.fixture(scope="module")
def server(long_token_tokenizer):
    # Precompiled (a step that compiled while the watchers watch would be a stall), with one step shape: the
    # model only ever runs one short stream at a time here.
    with serve_process("--tokenizer", str(long_token_tokenizer), "--keep-alive-timeout-s", str(KEEP_ALIVE_S),
                       "--read-timeout-s", str(READ_TIMEOUT_S), "--max-num-seqs", "4", "--max-num-batched-tokens",
                       "16", "--token-buckets", "[16]", "--request-buckets", "[4]") as process:
        process.port = int(process.url.rsplit(":", 1)[1])
        yield process


# ---- tokenization does not stall the server ---------------------------------------------------------------------
def watch(url: str, stop: threading.Event) -> dict:
    """Until `stop`: back-to-back streams (the gaps between their chunks) and /health polls (their latency)."""
    seen = {"gaps": [], "health": [], "streams": 0}

    def stream():
        with httpx.Client(base_url=url, timeout=30) as session:
            while not stop.is_set():
                # Special tokens kept: every step's token is a chunk (past the answer the model says </s>,
                # which skipped would leave nothing to send until the end, and a "gap" would be the whole run).
                body = {"prompt": "1+1=", "max_tokens": 25, "ignore_eos": True, "temperature": 0, "stream": True,
                        "skip_special_tokens": False}
                with session.stream("POST", "/v1/completions", json=body) as response:
                    last = None
                    for line in response.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data: {"):
                            if last is not None:
                                seen["gaps"].append(now - last)
                            last = now
                seen["streams"] += 1

    def health():
        with httpx.Client(base_url=url, timeout=30) as session:
            while not stop.is_set():
                start = time.monotonic()
                assert session.get("/health").status_code == 200
                seen["health"].append(time.monotonic() - start)
                time.sleep(0.02)

    seen["threads"] = [threading.Thread(target=stream), threading.Thread(target=health)]
    for thread in seen["threads"]:
        thread.start()
    return seen


def flood(port: int, requests: list[bytes]) -> list[tuple[int, dict]]:
    """Every pre-encoded request at once, each on its own connection; (status, JSON body) of each. Raw
    sockets in threads: sendall and recv run without the GIL, so the client's own work never delays the
    watchers' timestamps (they share this process)."""
    results: list[tuple[int, dict] | None] = [None] * len(requests)

    def send(index: int, request: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(request)
            data, _ = read_until_closed(sock, 120)
        head, _, body = data.partition(b"\r\n\r\n")
        results[index] = int(head.split()[1]), json.loads(body)

    threads = [threading.Thread(target=send, args=item) for item in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def assert_not_stalled(server, requests: list[bytes]) -> list[tuple[int, dict]]:
    """Every stream gap and /health answer under 100 ms while `requests` are served: a hard bound from the
    issue (a server that tokenizes in its own process stalls for seconds here), not a speed measure. Up to
    three tries: a busy moment on a shared 2-core machine can slow one, while a stalling server fails all."""
    measured = []
    # The watchers run in this test process, whose heap holds every earlier test's objects: a garbage
    # collection there would pause them and show up as a server stall. Freeze the heap and collect
    # nothing while they watch.
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        return _watched(server, requests, measured)
    finally:
        gc.enable()
        gc.unfreeze()


def _watched(server, requests: list[bytes], measured: list[str]) -> list[tuple[int, dict]]:
    for _ in range(3):
        stop = threading.Event()
        seen = watch(server.url, stop)
        time.sleep(0.3)  # the watchers are running
        try:
            responses = flood(server.port, requests)
            deadline = time.monotonic() + 10  # enough samples, also when the flood was quickly done
            while (len(seen["gaps"]) < 5 or len(seen["health"]) < 5) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            for thread in seen["threads"]:
                thread.join(30)
        assert seen["streams"] and len(seen["gaps"]) >= 5 and len(seen["health"]) >= 5, seen
        worst_gap, worst_health = max(seen["gaps"]), max(seen["health"])
        if worst_gap < 0.1 and worst_health < 0.1:
            return responses
        measured.append(f"stream gap {worst_gap:.3f} s, /health {worst_health:.3f} s")
    pytest.fail(f"the server stalled in every try: {measured}")


def completions_and_chats(text: str, count: int) -> list[bytes]:
    """`count` whole HTTP requests sending `text`, alternately as a chat message and as a completion
    prompt (each encoded once)."""
    def request(path: str, body: dict) -> bytes:
        data = json.dumps(body).encode()
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode() + data

    chat = request("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    completion = request("/v1/completions", {"prompt": text})
    return [completion if i % 2 else chat for i in range(count)]


def test_32_megabyte_prompts_are_refused_unread_without_stalling(server):
    """~1 MB prompts cannot fit 32 tokens of at most 20,000 characters: refused by their length (naming
    the limit) before anything is tokenized, the chats after their template is rendered (in a worker)."""
    text = "12+34=" * 166_000
    for status, body in assert_not_stalled(server, completions_and_chats(text, 32)):
        assert status == 400 and "max_model_len=32" in body["error"]["message"], body


def test_prompts_tokenized_in_workers_do_not_stall(server):
    """100,000-character prompts pass the length bound: a worker tokenizes each (about as long as the
    server would hold its GIL for them), then their token count refuses them."""
    text = "12+34=" * 16_667
    for status, body in assert_not_stalled(server, completions_and_chats(text, 6)):
        assert status == 400 and f"(length {len(text) + 1})" in body["error"]["message"], body  # "<s>" + text


# ---- connections --------------------------------------------------------------------------------------------------
def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) from a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_keep_alive_outlasts_client_pools_then_closes(server):
    from jaxserve.config import ServerConfig

    assert ServerConfig().keep_alive_timeout_s >= 30  # well past httpx's 5 s pool expiry
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for _ in range(2):  # the second request reuses the connection after an idle pause
            sock.sendall(HEALTH)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            time.sleep(KEEP_ALIVE_S / 2)
        data, waited = read_until_closed(sock, 10)
    assert data == b"" and waited < KEEP_ALIVE_S + 5  # closed after keep_alive_timeout_s
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # never sends a byte
        assert read_until_closed(sock, 10)[0] == b""


@pytest.mark.parametrize("partial", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
                                     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                     b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": "],
                         ids=["half-a-head", "half-a-body"])
def test_stalled_request_is_closed_with_408(server, partial):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(partial)
        data, waited = read_until_closed(sock, 10)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert "read_timeout_s" in json.loads(data.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert waited < READ_TIMEOUT_S + 5


def test_slow_but_whole_request_is_served(server):
    body = json.dumps({"prompt": "12+34=", "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        time.sleep(READ_TIMEOUT_S / 3)
        sock.sendall(body)
        data, _ = read_until_closed(sock, 30)
    assert data.startswith(b"HTTP/1.1 200") and json.loads(data.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == "46"
