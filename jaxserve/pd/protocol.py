"""The prefill/decode control protocol: small authenticated messages over TCP (no pickle, nothing executable).

    frame:  MAGIC (4 B) | header length (u32, big-endian) | header (UTF-8 JSON object)
            | HMAC-SHA256(key, MAGIC | length | header) (32 B) | payload (header["payload_bytes"] bytes)
    header: {"type", "transfer_id", "nonce", "sent_at", ...fields}; a payload's SHA-256 is a header
            field ("payload_sha256"), so the HMAC over the header authenticates the payload too.

One exchange per connection: the client sends one message and reads one reply; the server answers each
message with one reply (or closes the connection on a bad one). The header's length is capped
(MAX_HEADER_BYTES) before anything is read, the payload's by the receiver, and the whole message must
arrive before its deadline, so a slow or oversized sender is cut off instead of holding a thread.
A message is accepted once: its nonce is remembered for `replay_window_s`, and one sent longer ago than
that is refused, so a duplicate or late copy is recognised (the server replies "ignored").

The key is derived from the shared token (server.kv_transfer_token); without a token the key is fixed and
only loopback addresses may be bound or used (check_bind), since anyone who can connect could then speak.
The router signs the kv_transfer_params it hands to instances with the same key (sign_params), so a client
cannot point a prefill instance at an address of its choosing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"JXPD"
MAX_HEADER_BYTES = 8 << 20  # a reserve carries the prompt's token ids: a 128K-token prompt is ~1 MiB
_MAC_BYTES = 32
_TRANSFER_ID = re.compile(r"^[0-9a-f]{16,64}$")
MESSAGE_TYPES = frozenset({"reserve", "reserved", "refused", "ready", "ack", "nack", "abort", "ignored"})


class ProtocolError(Exception):
    """A message that is malformed, unauthenticated, too large, too slow, or a duplicate."""


def derive_key(token: str | None) -> bytes:
    return hashlib.sha256(b"jaxserve.pd.v1|" + (token or "").encode()).digest()


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (an IPv6 host in brackets) -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not a host:port address (e.g. 127.0.0.1:7100)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(address: str, token: str | None) -> None:
    """Refuse a KV transfer endpoint that anyone could reach without the shared token."""
    host, _ = split_address(address)
    if token is None and not is_loopback(host):
        raise ValueError(f"server.kv_transfer_address={address!r} is not a loopback address and "
                         f"server.kv_transfer_token is unset: anyone who can reach it could reserve blocks and "
                         f"write KV; set server.kv_transfer_token (the same secret on every instance and the "
                         f"router) or bind 127.0.0.1")


def sign_params(key: bytes, transfer_id: str, decode_address: str) -> str:
    """The router's signature of one request's transfer parameters (hex)."""
    return hmac.new(key, f"params|{transfer_id}|{decode_address}".encode(), hashlib.sha256).hexdigest()


def check_params_signature(key: bytes, transfer_id: str, decode_address: str, signature: str) -> bool:
    return hmac.compare_digest(sign_params(key, transfer_id, decode_address), str(signature))


def bind_transfer(prepared: Any, params: Any, index: int, key: bytes, role: str) -> None:
    """Checks the router's signed kv_transfer_params (ValueError naming what is wrong) and binds prompt
    `index`'s transfer to `prepared` (a PreparedRequest); a prefill instance computes one token."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object set by `jaxserve router`")
    transfer_id, address, signature = (params.get(k) for k in ("transfer_id", "decode_address", "signature"))
    if not (isinstance(transfer_id, str) and _TRANSFER_ID.match(transfer_id) and isinstance(address, str)
            and isinstance(signature, str) and check_params_signature(key, transfer_id, address, signature)):
        raise ValueError("kv_transfer_params is not signed with this instance's server.kv_transfer_token; "
                         "only `jaxserve router` (with the same token) sets it")
    split_address(address)
    if role == "prefill":
        prepared.max_tokens = 1
        prepared.params = dataclasses.replace(prepared.params, n=1)
    prepared.kv_transfer_params = {"transfer_id": f"{transfer_id}.{index}", "decode_address": address}


def new_transfer_id() -> str:
    return os.urandom(16).hex()


def encode(key: bytes, kind: str, transfer_id: str, payload: bytes = b"", **fields: Any) -> bytes:
    """One framed message; `fields` must be JSON values."""
    if kind not in MESSAGE_TYPES:
        raise ValueError(f"unknown message type {kind!r}")
    header = {"type": kind, "transfer_id": transfer_id, "nonce": os.urandom(12).hex(), "sent_at": time.time(),
              **fields}
    if payload:
        header["payload_bytes"] = len(payload)
        header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"a {kind} message header of {len(body)} bytes passes the cap of {MAX_HEADER_BYTES}")
    framed = MAGIC + struct.pack(">I", len(body)) + body
    return framed + hmac.new(key, framed, hashlib.sha256).digest() + payload


def _read_exact(sock: socket.socket, count: int, deadline: float) -> bytes:
    chunks, left = [], count
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProtocolError(f"message timed out with {left} of {count} bytes unread")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            raise ProtocolError(f"message timed out with {left} of {count} bytes unread") from None
        if not chunk:
            raise ProtocolError(f"connection closed with {left} of {count} bytes unread (truncated message)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(sock: socket.socket, key: bytes, timeout_s: float,
                 max_payload_bytes: int = 0) -> tuple[dict, bytes]:
    """(header, payload) of one message, authenticated and checked; ProtocolError otherwise. The whole
    message must arrive within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    prefix = _read_exact(sock, 8, deadline)
    if prefix[:4] != MAGIC:
        raise ProtocolError("not a jaxserve PD control message (bad magic)")
    (length,) = struct.unpack(">I", prefix[4:])
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {length} bytes passes the cap of {MAX_HEADER_BYTES}")
    body = _read_exact(sock, length, deadline)
    mac = _read_exact(sock, _MAC_BYTES, deadline)
    if not hmac.compare_digest(mac, hmac.new(key, prefix + body, hashlib.sha256).digest()):
        raise ProtocolError("authentication failed (wrong server.kv_transfer_token, or a tampered message)")
    try:
        header = json.loads(body)
    except ValueError as err:
        raise ProtocolError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict) or header.get("type") not in MESSAGE_TYPES \
            or not isinstance(header.get("transfer_id"), str) or not isinstance(header.get("nonce"), str) \
            or not isinstance(header.get("sent_at"), (int, float)):
        raise ProtocolError("header lacks type, transfer_id, nonce or sent_at")
    size = header.get("payload_bytes", 0)
    if not isinstance(size, int) or size < 0:
        raise ProtocolError(f"bad payload_bytes {size!r}")
    if size > max_payload_bytes:
        raise ProtocolError(f"payload of {size} bytes passes the cap of {max_payload_bytes}")
    payload = _read_exact(sock, size, deadline) if size else b""
    if size and hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise ProtocolError("payload checksum mismatch (corrupted or truncated transfer)")
    return header, payload


class ReplayGuard:
    """Remembers accepted nonces for `window_s`; refuses a repeated nonce or a message sent before the window."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.time):
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def check(self, header: dict) -> str | None:
        """None when fresh (and now remembered), else why it is ignored."""
        now = self.clock()
        sent_at = float(header["sent_at"])
        if now - sent_at > self.window_s:
            return f"late: sent {now - sent_at:.1f} s ago, past the {self.window_s} s replay window"
        with self._lock:
            if len(self._seen) > 4096:
                self._seen = {n: t for n, t in self._seen.items() if now - t <= self.window_s}
            if header["nonce"] in self._seen:
                return "duplicate message (nonce seen before)"
            self._seen[header["nonce"]] = sent_at
        return None


def request(address: str, key: bytes, data: bytes, timeout_s: float, max_reply_bytes: int = 0) -> dict:
    """Send one framed message to `address` and return the reply's header; ProtocolError or OSError on
    failure (refused connection, timeout, bad reply)."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        sock.sendall(data)
        header, _ = read_message(sock, key, max(1e-3, deadline - time.monotonic()), max_reply_bytes)
    return header


class ControlServer:
    """A threaded TCP server: each connection carries one message, answered by `handler(header, payload)`
    -> (reply type, reply fields). Bad messages are logged and their connection closed unanswered; a
    duplicate or late one is answered "ignored" without reaching the handler."""

    def __init__(self, address: str, key: bytes, handler: Callable[[dict, bytes], tuple[str, dict]], *,
                 timeout_s: float, max_payload_bytes: int, replay_window_s: float = 60.0):
        host, port = split_address(address)
        self.key = key
        self.handler = handler
        self.timeout_s = timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.replay = ReplayGuard(replay_window_s)
        self.num_rejected = 0
        owner = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self):
                owner._serve_one(self.request)

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_cls = type("_Server", (socketserver.ThreadingTCPServer,),
                          {"address_family": family, "daemon_threads": True, "allow_reuse_address": True})
        self._server = server_cls((host, port), _Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="jaxserve-pd-control", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve_one(self, sock: socket.socket) -> None:
        try:
            header, payload = read_message(sock, self.key, self.timeout_s, self.max_payload_bytes)
        except (ProtocolError, OSError) as err:
            self.num_rejected += 1
            logger.warning("PD control: rejected a message: %s", err)
            return
        why = self.replay.check(header)
        if why is not None:
            kind, fields = "ignored", {"reason": why}
        else:
            try:
                kind, fields = self.handler(header, payload)
            except Exception as err:  # noqa: BLE001 - a handler failure answers the peer, never kills the server
                logger.exception("PD control: handling a %s failed", header["type"])
                kind, fields = "nack", {"reason": f"{type(err).__name__}: {err}"}
        try:
            sock.settimeout(self.timeout_s)
            sock.sendall(encode(self.key, kind, header["transfer_id"], **fields))
        except OSError as err:
            logger.warning("PD control: could not reply to a %s: %s", header["type"], err)
