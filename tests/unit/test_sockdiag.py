"""Listening sockets over netlink sock_diag: the message parser on crafted bytes, and one live dump
that must find a loopback listener this test opens (the kernel's own answer, no /proc read)."""

from __future__ import annotations

import socket
import struct

import pytest

from proxy.gpu.snapshot import Listener
from proxy.gpu.sockdiag import NLMSG_DONE, NLMSG_ERROR, SOCK_DIAG_BY_FAMILY, TCP_LISTEN, parse_messages, read_listeners_netlink


def message(kind: int, payload: bytes) -> bytes:
    body = struct.pack("=IHHII", 16 + len(payload), kind, 0, 1, 0) + payload
    return body + bytes(-len(body) % 4)


def diag(family: int, state: int, address: bytes, port: int, uid: int, inode: int) -> bytes:
    sockid = port.to_bytes(2, "big") + bytes(2) + address.ljust(16, b"\0") + bytes(16) + bytes(4) + bytes(8)
    return message(SOCK_DIAG_BY_FAMILY, struct.pack("=BBBB48sIIIII", family, state, 0, 0, sockid, 0, 0, 0, uid, inode)
                   + b"\x08\x00\x01\x00extra")  # a trailing attribute the parser must step over


def test_messages_give_v4_v6_and_mapped_listeners_and_stop_at_done() -> None:
    data = (diag(socket.AF_INET, TCP_LISTEN, socket.inet_aton("127.0.0.1"), 11434, 997, 101)
            + diag(socket.AF_INET6, TCP_LISTEN, socket.inet_pton(socket.AF_INET6, "::"), 8188, 1000, 102)
            + diag(socket.AF_INET6, TCP_LISTEN, socket.inet_pton(socket.AF_INET6, "::ffff:127.0.0.1"), 5000, 1000, 103)
            + diag(socket.AF_INET, 1, socket.inet_aton("127.0.0.1"), 40000, 1000, 104)  # not listening
            + message(NLMSG_DONE, bytes(4)))
    got, done = parse_messages(data, socket.AF_INET)
    assert done and got == [Listener(101, "127.0.0.1", 11434, 997), Listener(102, "::", 8188, 1000),
                            Listener(103, "127.0.0.1", 5000, 1000)]


def test_a_refused_dump_raises_oserror_for_the_fallback() -> None:
    with pytest.raises(OSError):
        parse_messages(message(NLMSG_ERROR, struct.pack("=i", -1) + bytes(16)), socket.AF_INET)


def test_live_dump_finds_a_loopback_listener_we_opened() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        try:
            listeners = read_listeners_netlink()
        except OSError as exc:
            pytest.skip(f"netlink sock_diag not available here: {exc}")
        assert [(lst.address, lst.port) for lst in listeners if lst.port == port] == [("127.0.0.1", port)]
