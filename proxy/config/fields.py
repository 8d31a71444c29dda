"""The strict base every section of tenants.json is made of, and the small rules its values share:
host:port, upstream URLs, Host allow-lists, device lists, one configured HTTP call."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from proxy.config.bounds import bound_for, is_number

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _in_bounds(cls, value: object, info: ValidationInfo) -> object:
        bound = bound_for(info.field_name or "")
        if bound is None:
            return value
        if isinstance(value, dict):  # model_vram_gb: one bound for every entry
            for key, inner in value.items():
                problem = bound.problem(inner) if is_number(inner) else None
                if problem:
                    raise ValueError(f"{key!r} {problem}")
        elif is_number(value):
            problem = bound.problem(value)
            if problem:
                raise ValueError(problem)
        return value


def no_spaces(value: str) -> None:
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{value!r} contains a space or control character")


def host_port(value: str) -> str:
    no_spaces(value)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port (like 127.0.0.1:11435), got {value!r}")
    if int(port) == 0:
        raise ValueError("port 0 picks a new random port at every start, so no client could find it: use a fixed port 1-65535")
    if int(port) > 65535:
        raise ValueError(f"port {port} is out of range: use 1-65535")
    return value


_HOST_ENTRY = re.compile(r"^(\*|(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?|[0-9a-f:.]+|\[[0-9a-f:.]+\])$")


def host_list(values: list[str]) -> list[str]:
    """Host names without port: `gpu.example.com`, `*.example.com`, an address, or `*` (no check)."""
    out = [v.strip().lower() for v in values]
    for v in out:
        if not _HOST_ENTRY.match(v) or (v.count(":") == 1 and not v.startswith("[")):
            raise ValueError(f"expected a host name without port (like gpu.example.com, *.example.com, "
                             f"192.168.1.5 or *), got {v!r}")
    return out


_DEVICE_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")


def device_list(values: list[int | str] | None) -> list[int | str] | None:
    """`devices`: NVML indices (0, 1, ...) or UUIDs as `nvidia-smi -L` prints them (GPU-..., MIG-...)."""
    if values is None:
        return None
    if not values:
        raise ValueError("an empty list pins the tenant to no GPU: leave devices out (any device) or name one, like [0]")
    seen: set[str] = set()
    for v in values:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"{v} is not a device index: NVML counts from 0 (`nvidia-smi -L`)")
        if isinstance(v, str) and not _DEVICE_UUID.fullmatch(v):
            raise ValueError(f"{v!r} is neither a device index nor a UUID like 'GPU-8f2c...' (`nvidia-smi -L` lists them)")
        key = str(v).lower()
        if key in seen:
            raise ValueError(f"{v!r} is listed twice")
        seen.add(key)
    return values


def upstream_url(value: str) -> str:
    no_spaces(value)
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:  # a port that is no number or out of range, a broken [v6] address
        raise ValueError(f"expected http(s)://host:port with a port 1-65535, got {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
    if port == 0:
        raise ValueError(f"port 0 in {value!r}: use the engine's port (1-65535)")
    # Relays send each request's own path to host:port, so anything more would be silently ignored.
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"expected only scheme://host:port, got {value!r}: a path, query or user here would be "
                         "ignored (each request keeps its own path)")
    return value.rstrip("/")


HttpMethod = Literal["GET", "POST", "PUT", "DELETE"]


def call_url(value: str) -> str:
    no_spaces(value)
    if value.startswith("/"):
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected a path on the upstream (like /wake_up) or an http(s):// URL, got {value!r}")
    return value


class HttpCall(StrictModel):
    """One HTTP call the proxy makes to the app: the shape of an `http` release (method, url, body)."""

    method: HttpMethod = Field(default="POST", description="the HTTP method")
    url: str = Field(description="absolute URL, or a path on the upstream")
    body: dict[str, object] | None = Field(default=None, description="JSON body to send")

    _url = field_validator("url")(call_url)


