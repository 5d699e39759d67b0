"""The PD control protocol: authenticated, size- and time-bounded messages; tampered, oversized and slow
messages are rejected, duplicate and late ones ignored."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from jaxserve.pd import protocol as proto

KEY = proto.derive_key("secret")


@pytest.fixture()
def server():
    seen = []

    def handler(header, payload):
        seen.append((header, payload))
        return "ack", {"got": len(payload)}

    srv = proto.ControlServer("127.0.0.1:0", KEY, handler, timeout_s=0.5, max_payload_bytes=1 << 16,
                              replay_window_s=5.0).start()
    srv.seen = seen
    yield srv
    srv.close()


def _raw(address: str, data: bytes, wait: float = 2.0) -> bytes:
    """Send raw bytes, return whatever the server answers before closing."""
    host, port = proto.split_address(address)
    with socket.create_connection((host, port), timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def test_round_trip_with_payload(server):
    reply = proto.request(server.address, KEY, proto.encode(KEY, "ready", "t1", b"x" * 1000, n=3), timeout_s=2)
    assert reply["type"] == "ack" and reply["got"] == 1000 and reply["transfer_id"] == "t1"
    header, payload = server.seen[0]
    assert header["n"] == 3 and payload == b"x" * 1000


def test_tampered_header_payload_and_wrong_key_are_rejected(server):
    good = proto.encode(KEY, "reserve", "t2", b"abc", n=1)
    tampered_header = good.replace(b'"n":1', b'"n":2')
    tampered_payload = good[:-3] + b"abd"
    wrong_key = proto.encode(proto.derive_key("other"), "reserve", "t2", n=1)
    for data in (tampered_header, tampered_payload, wrong_key):
        assert _raw(server.address, data) == b""  # closed unanswered
    assert server.seen == [] and server.num_rejected == 3


def test_oversize_header_and_payload_are_rejected_before_reading(server):
    huge = proto.MAGIC + struct.pack(">I", proto.MAX_HEADER_BYTES + 1)
    assert _raw(server.address, huge) == b""
    too_big = proto.encode(KEY, "ready", "t3", b"y" * ((1 << 16) + 1))
    assert _raw(server.address, too_big) == b""
    assert server.seen == [] and server.num_rejected == 2
    with pytest.raises(proto.ProtocolError, match="cap"):  # the client side caps replies too
        srv_reply = proto.encode(KEY, "ack", "t", b"z" * 10)
        a, b = socket.socketpair()
        a.sendall(srv_reply)
        proto.read_message(b, KEY, 1.0, max_payload_bytes=5)


def test_slow_sender_is_cut_off(server):
    data = proto.encode(KEY, "reserve", "t4", n=1)
    host, port = proto.split_address(server.address)
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(data[:10])  # then stalls past the server's 0.5 s message timeout
        assert sock.recv(100) == b""
    assert time.monotonic() - start < 4
    assert server.seen == [] and server.num_rejected == 1


def test_truncated_message_is_rejected(server):
    data = proto.encode(KEY, "ready", "t5", b"p" * 5000)
    host, port = proto.split_address(server.address)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(data[:-100])
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(100) == b""
    assert server.seen == [] and server.num_rejected == 1


def test_duplicate_and_late_messages_are_ignored(server):
    data = proto.encode(KEY, "abort", "t6")
    assert proto.request(server.address, KEY, data, timeout_s=2)["type"] == "ack"
    again = proto.request(server.address, KEY, data, timeout_s=2)
    assert again["type"] == "ignored" and "duplicate" in again["reason"]
    guard = proto.ReplayGuard(5.0)
    late = {"nonce": "n", "sent_at": time.time() - 60}
    assert "late" in guard.check(late)
    assert len(server.seen) == 1


def test_bind_refuses_a_public_address_without_a_token():
    proto.check_bind("127.0.0.1:0", None)
    proto.check_bind("0.0.0.0:7100", "secret")
    with pytest.raises(ValueError, match="kv_transfer_token"):
        proto.check_bind("0.0.0.0:7100", None)
    with pytest.raises(ValueError, match="host:port"):
        proto.check_bind("nohost", None)


def test_params_signature():
    sig = proto.sign_params(KEY, "tid", "127.0.0.1:1")
    assert proto.check_params_signature(KEY, "tid", "127.0.0.1:1", sig)
    assert not proto.check_params_signature(KEY, "tid", "127.0.0.1:2", sig)
    assert not proto.check_params_signature(proto.derive_key("x"), "tid", "127.0.0.1:1", sig)
