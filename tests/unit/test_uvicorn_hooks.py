"""The uvicorn internals the listeners build on are where proxy/relay/ expects them.

proxy/relay/inbound.py subclasses uvicorn's HttpToolsProtocol (it overrides the connection and
parser callbacks, copies `data_received`, and reads the protocol's and the request cycle's
attributes), and proxy/relay/servers.py subclasses uvicorn.Server (`capture_signals`, `shutdown`).
None of that is uvicorn's public API, so pyproject.toml holds uvicorn to one minor range. When a
new uvicorn moves a hook, these tests name the hook and the version: review inbound.py and
servers.py against the new uvicorn, then widen the pin.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import Server, ServerState

from proxy.relay.inbound import ABORT, HEAD_WITH_BODY, SERVING, Guard, GuardedHttpProtocol

ROOT = Path(__file__).resolve().parents[2]
VERSION = uvicorn.__version__
PIN = next(Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
           if Requirement(r).name == "uvicorn")


def moved(what: str, user: str = "proxy/relay/inbound.py") -> str:
    return (f"uvicorn {VERSION}: {what}; {user} relies on it (pyproject.toml pins {PIN}): "
            f"review {user} against this uvicorn, then widen the pin")


def params(fn: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def assigned(fn: Callable[..., Any]) -> set[str]:
    """The `self.x` attributes a method assigns."""
    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", inspect.getsource(fn)))


def called(fn: Callable[..., Any]) -> set[str]:
    """The `self.x(...)` / `self.x.y(...)` calls a method makes."""
    return set(re.findall(r"self\.([\w.]+)\(", inspect.getsource(fn)))


def test_the_installed_uvicorn_is_the_pinned_minor() -> None:
    assert PIN.specifier.contains(VERSION), moved(f"installed, but pyproject.toml pins {PIN}")
    assert any(s.operator == "<" for s in PIN.specifier), f"uvicorn is not held to one minor range: {PIN}"


# method -> its parameters after self: what GuardedHttpProtocol overrides or calls
PROTOCOL_HOOKS = {
    "__init__": ["config", "server_state", "app_state", "_loop"],
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "on_message_begin": [],
    "on_url": ["url"],
    "on_header": ["name", "value"],
    "on_headers_complete": [],
    "on_message_complete": [],
    "_unset_keepalive_if_required": [],
    "_should_upgrade": [],
    "handle_websocket_upgrade": [],
    "_unsupported_upgrade_warning": [],
    "send_400_response": ["msg"],
    "shutdown": [],  # servers.py's shutdown calls it on every connection
    "_start_asgi_task": ["cycle", "app"],
    "on_response_complete": [],
    "timeout_keep_alive_handler": [],
}


def test_http_tools_protocol_has_every_method_inbound_overrides_or_calls() -> None:
    for name, expected in PROTOCOL_HOOKS.items():
        fn = getattr(HttpToolsProtocol, name, None)
        assert callable(fn), moved(f"HttpToolsProtocol.{name} is gone")
        assert params(fn) == expected, moved(f"HttpToolsProtocol.{name} takes {params(fn)}, not {expected}")


def test_data_received_still_does_what_inbounds_copy_does() -> None:
    # GuardedHttpProtocol.data_received is uvicorn's with the head checks around the parser: a change
    # in uvicorn's would be silently lost in the copy
    assert called(HttpToolsProtocol.data_received) == {
        "_unset_keepalive_if_required", "parser.feed_data", "logger.warning", "send_400_response",
        "_should_upgrade", "handle_websocket_upgrade", "_unsupported_upgrade_warning",
    }, moved(f"HttpToolsProtocol.data_received changed: it calls {sorted(called(HttpToolsProtocol.data_received))}")
    source = inspect.getsource(HttpToolsProtocol.data_received)
    for exc in ("httptools.HttpParserError", "httptools.HttpParserUpgrade"):
        assert exc in source, moved(f"HttpToolsProtocol.data_received no longer catches {exc}")


def test_start_asgi_task_still_does_what_inbounds_copy_does() -> None:
    # GuardedHttpProtocol._start_asgi_task is uvicorn's, keeping the task it starts
    assert called(HttpToolsProtocol._start_asgi_task) == {"loop.create_task", "tasks.add"}, moved(
        f"HttpToolsProtocol._start_asgi_task changed: it calls {sorted(called(HttpToolsProtocol._start_asgi_task))}")
    source = inspect.getsource(HttpToolsProtocol._start_asgi_task)
    for part in ("cycle.run_asgi(app)", "reset_contextvars", "add_done_callback(self.tasks.discard)"):
        assert part in source, moved(f"HttpToolsProtocol._start_asgi_task no longer has {part}")


def test_on_response_complete_still_does_what_inbounds_copy_does() -> None:
    # GuardedHttpProtocol.on_response_complete is uvicorn's with the keep-alive timer of its listener
    # (Guard.rest) in place of loop.call_later, and the keep-alive attribute that timer replaces
    assert called(HttpToolsProtocol.on_response_complete) == {
        "transport.is_closing", "_unset_keepalive_if_required", "flow.resume_reading", "pipeline.pop",
        "_start_asgi_task", "loop.call_later",
    }, moved(f"HttpToolsProtocol.on_response_complete changed: it calls "
             f"{sorted(called(HttpToolsProtocol.on_response_complete))}")
    source = inspect.getsource(HttpToolsProtocol.on_response_complete)
    for part in ("server_state.total_requests += 1", "self.timeout_keep_alive_handler", "self.timeout_keep_alive,"):
        assert part in source, moved(f"HttpToolsProtocol.on_response_complete no longer has {part}")
    assert "timeout_keep_alive_task" in inspect.getsource(HttpToolsProtocol._unset_keepalive_if_required), moved(
        "HttpToolsProtocol._unset_keepalive_if_required no longer cancels timeout_keep_alive_task")
    assert called(HttpToolsProtocol.timeout_keep_alive_handler) == {"transport.is_closing", "transport.close"}, moved(
        "HttpToolsProtocol.timeout_keep_alive_handler changed")


def test_the_cycle_writes_through_its_own_transport_attribute() -> None:
    # inbound's head_with_body extension swaps the cycle's `transport` for one answer
    source = inspect.getsource(RequestResponseCycle.send)
    assert source.count("self.transport.write(") >= 3, moved("RequestResponseCycle.send no longer writes via self.transport")
    assert "transport" in assigned(RequestResponseCycle.__init__), moved("RequestResponseCycle no longer sets self.transport")


def test_the_protocol_and_cycle_attributes_inbound_reads_are_set() -> None:
    loop = asyncio.new_event_loop()
    try:
        config = Config(app=lambda scope, receive, send: None, log_config=None)
        proto = HttpToolsProtocol(config, ServerState(), {}, loop)
    finally:
        loop.close()
    for attr in ("config", "loop", "logger", "parser", "connections", "transport", "flow", "client", "scope", "cycle"):
        assert hasattr(proto, attr), moved(f"HttpToolsProtocol no longer sets self.{attr} in __init__")
    assert proto.loop is loop, moved("HttpToolsProtocol no longer runs on the `_loop` it is given")
    made = assigned(HttpToolsProtocol.connection_made)
    assert {"transport", "flow", "client"} <= made, moved(f"HttpToolsProtocol.connection_made sets {sorted(made)}")
    cycle = assigned(RequestResponseCycle.__init__)
    for attr in ("scope", "response_complete", "keep_alive", "disconnected"):
        assert attr in cycle, moved(f"RequestResponseCycle no longer sets self.{attr}")
    assert params(FlowControl.__init__) == ["transport"], moved(f"FlowControl takes {params(FlowControl.__init__)}")
    for status in (408, 414, 431, 503):
        assert STATUS_LINE.get(status, b"").startswith(b"HTTP/1.1 %d " % status), moved(f"STATUS_LINE[{status}] moved")


def test_a_protocol_factory_is_still_what_config_http_takes() -> None:
    # servers.py passes Guard.protocol as Config(http=...); uvicorn calls it with these keywords
    guard = Guard("test")
    config = Config(app=lambda scope, receive, send: None, http=guard.protocol, log_config=None)  # type: ignore[arg-type]
    config.load()
    assert config.http_protocol_class == guard.protocol, moved("Config(http=callable) is no longer the protocol factory")
    startup = inspect.getsource(Server.startup)
    for keyword in ("config=", "server_state=", "app_state=", "_loop="):
        assert keyword in startup, moved(f"Server.startup no longer calls the protocol factory with {keyword}")
    assert params(Guard.protocol) == PROTOCOL_HOOKS["__init__"]
    assert issubclass(GuardedHttpProtocol, HttpToolsProtocol)


def test_server_has_what_servers_py_overrides_and_reads() -> None:
    user = "proxy/relay/servers.py"
    assert params(Server.capture_signals) == [], moved("Server.capture_signals changed", user)
    assert params(Server.shutdown) == ["sockets"], moved(f"Server.shutdown takes {params(Server.shutdown)}", user)
    assert params(Server.serve) == ["sockets"], moved(f"Server.serve takes {params(Server.serve)}", user)
    server = Server(Config(app=lambda scope, receive, send: None, log_config=None))
    for attr in ("server_state", "started", "should_exit", "force_exit"):
        assert hasattr(server, attr), moved(f"Server no longer sets self.{attr}", user)
    assert "lifespan" in assigned(Server._serve), moved("Server._serve no longer sets self.lifespan", user)
    assert "servers" in assigned(Server.startup), moved("Server.startup no longer sets self.servers", user)
    state = ServerState()
    assert isinstance(state.connections, set) and isinstance(state.tasks, set), moved("ServerState's sets moved", user)


# uvicorn's parser callbacks that inbound.py carries a copy of (with its head checks folded in), and
# the source they were copied from: a new uvicorn that changes one fails here, to be copied again.
COPIED_CALLBACKS = {
    "on_message_begin": "96d377fdc7c2baef",
    "on_url": "37be44e962b04ca8",
    "on_header": "1e86ebb6cea0458c",
    "on_message_complete": "1fbad42dc31fc01f",
}


def test_the_parser_callbacks_inbound_copies_are_still_uvicorns_as_copied() -> None:
    for name, digest in COPIED_CALLBACKS.items():
        source = inspect.getsource(getattr(HttpToolsProtocol, name))
        assert hashlib.sha256(source.encode()).hexdigest()[:16] == digest, moved(
            f"HttpToolsProtocol.{name} changed; GuardedHttpProtocol.{name} is a copy of the old one")


def _fed(protocol_class: type[HttpToolsProtocol], data: bytes) -> HttpToolsProtocol:
    """A protocol of this class that was sent `data` on a fresh connection (its app never runs)."""
    loop = asyncio.new_event_loop()
    try:
        config = Config(app=lambda scope, receive, send: None, log_config=None)
        config.load()
        if protocol_class is GuardedHttpProtocol:
            proto: HttpToolsProtocol = Guard("test").protocol(config, ServerState(), {"k": 1}, loop)
        else:
            proto = protocol_class(config, ServerState(), {"k": 1}, loop)
        proto._start_asgi_task = lambda cycle, app: None  # type: ignore[method-assign]
        proto.connection_made(_Transport())  # type: ignore[arg-type]
        proto.data_received(data)
        if isinstance(proto, GuardedHttpProtocol):
            proto._disarm_head_timer()
    finally:
        loop.close()
    return proto


class _Transport:
    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: bytes) -> None:
        pass


@pytest.mark.parametrize("request_bytes", [
    b"GET /a%20b?x=1 HTTP/1.1\r\nHost: h\r\nX-Pad: v \t\r\nACCEPT: */*\r\n\r\n",
    b"POST /p HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\nabc",
    b"GET / HTTP/1.0\r\n\r\n",
    b"GET http://h/p%2Fq?a=%20 HTTP/1.1\r\nHost: h\r\n\r\n",
], ids=["get", "expect-and-body", "http-1.0", "absolute-form"])
def test_the_copied_callbacks_leave_the_request_as_uvicorns_own_do(request_bytes: bytes) -> None:
    theirs, ours = _fed(HttpToolsProtocol, request_bytes), _fed(GuardedHttpProtocol, request_bytes)
    ours_scope = dict(ours.scope)
    assert set(ours_scope.pop("extensions")) >= {ABORT, SERVING, HEAD_WITH_BODY}  # type: ignore[call-overload]
    assert ours_scope == dict(theirs.scope)
    assert (ours.url, ours.headers, ours.expect_100_continue) == (theirs.url, theirs.headers, theirs.expect_100_continue)
    assert ours.cycle is not None and theirs.cycle is not None
    assert (ours.cycle.more_body, ours.cycle.body, ours.cycle.keep_alive) == \
        (theirs.cycle.more_body, theirs.cycle.body, theirs.cycle.keep_alive)
    assert ours.cycle.message_event.is_set() == theirs.cycle.message_event.is_set()
    # the scope built for an inline GET a task takes over (GuardedHttpProtocol.request_scope) is uvicorn's too
    assert isinstance(ours, GuardedHttpProtocol)
    method, version = theirs.scope["method"], theirs.scope["http_version"]
    built = dict(ours.request_scope(method, version, theirs.url, theirs.headers))
    built.pop("extensions")
    assert built == dict(theirs.scope)
