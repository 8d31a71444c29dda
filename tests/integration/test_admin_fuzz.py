"""Schemathesis against the admin API's own /openapi.json, with and without a token: no 5xx, and
every answer matches the document (status, content type, body schema). Valid data (positive) and
invalid data (negative: wrong types, out-of-range numbers, missing parameters), which must be
refused with a 4xx.

Bounded and repeatable: a fixed number of examples per operation and mode, derandomized (the same
cases on every run), no example database, no shrinking. The box serves on port 0 on loopback; the
schemathesis client runs in a thread while the event loop serves it.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings  # schemathesis brings hypothesis
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.boxes import DemoFactory, proxy_of

MAX_EXAMPLES = 25  # per operation and mode: the two runs take seconds, not minutes, on 2 cores
TOKEN = "fuzz-token"
CONFORMS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
CHECKS = {GenerationMode.POSITIVE: CONFORMS, GenerationMode.NEGATIVE: [*CONFORMS, negative_data_rejection]}
SKIPPED = {
    "/api/events": "an endless text/event-stream: a client that reads the whole body never returns",
    # The MCP SDK's transport: GET opens an event stream too, and its JSON-RPC 400/405 answers are
    # not in the document yet; tests/integration/test_mcp.py covers the tools.
    "/mcp": "the MCP SDK's streamable HTTP transport",
}


def with_known_tenants(document: dict[str, Any], tenants: list[str]) -> dict[str, Any]:
    """A random string names no tenant, so nearly every call would stop at the 404: tenant
    parameters take the real names and one unknown one, so plans and releases run too."""
    doc = copy.deepcopy(document)
    for path, ops in doc["paths"].items():
        if path == "/api/history":
            continue  # history keeps rows of tenants since removed: any name is a fair filter
        for op in ops.values():
            for param in op.get("parameters", []):
                if param["name"] in ("name", "tenant"):
                    param["schema"] = {"type": "string", "enum": [*tenants, "no-such-tenant"]}
    return doc


def describe(exc: BaseException) -> str:
    """A failure in a few lines: schemathesis groups its failures, each with a curl line to reproduce."""
    inner = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
    return "\n".join(f"  {type(e).__name__}: {str(e).strip()}"[:1500] for e in inner)


def fuzz(base_url: str, document: dict[str, Any], headers: dict[str, str]) -> tuple[list[str], int]:
    """Every documented operation but SKIPPED, in both modes; the failures, and the requests sent."""
    schema = schemathesis.openapi.from_dict(document)
    failures: list[str] = []
    sent = 0
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        if operation.path in SKIPPED:
            continue
        for mode, checks in CHECKS.items():
            count, problem = fuzz_operation(operation, mode, checks, base_url, headers)
            sent += count
            if isinstance(problem, Unsatisfiable):
                if mode is GenerationMode.POSITIVE:
                    raise problem
                # nothing to make invalid: no parameters, or only strings that take any value
            elif problem is not None:
                failures.append(f"{mode.value} {operation.method.upper()} {operation.path}: {describe(problem)}")
    return failures, sent


def fuzz_operation(operation: Any, mode: GenerationMode, checks: list[Any], base_url: str,
                   headers: dict[str, str]) -> tuple[int, BaseException | None]:
    """One operation in one mode: the requests sent, and what went wrong (None: nothing)."""
    sent = 0

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal sent
        sent += 1
        case.call_and_validate(base_url=base_url, headers=headers, checks=checks, timeout=30)

    try:
        run()
    except (Exception, BaseExceptionGroup) as exc:
        return sent, exc
    return sent, None


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
async def test_the_admin_api_keeps_to_its_openapi_document_under_fuzzing(
        box: DemoFactory, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, token: str | None) -> None:
    if token:
        monkeypatch.setenv("HYPERSWAP_ADMIN_TOKEN", token)
    demo = await box("default")
    admin = proxy_of(demo).url("admin")
    document = with_known_tenants((await http.get(admin + "/openapi.json")).json(), list(proxy_of(demo).registry.tenants))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    started = time.monotonic()
    failures, sent = await asyncio.to_thread(fuzz, admin, document, headers)
    took = time.monotonic() - started
    assert sent > 100, f"only {sent} requests sent: the fuzzing did not reach the operations"
    assert not failures, (f"{len(failures)} operation(s) broke the document ({sent} requests, {took:.1f} s):\n"
                          + "\n\n".join(failures))
