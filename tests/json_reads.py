"""The product's JSON as the tests read it: decisions (unit tests from a `DecisionLog`, box tests
through tests/integration/boxes.py `decisions`) and the OpenAPI document.

A test asserts deep inside a JSON value (`plan.outcome["releases"][0]["confirmed"] is True`,
`doc["components"]["schemas"]["Error"]["properties"]`), and the product keeps that value typed as JSON
(`JSONObject`, the document's `dict[str, object]` pieces), which mypy cannot index past its top. So a
test reads it here, as mappings of `Any` below the top: a wrong key fails the test as a KeyError, the
failure a test wants. The product reads the typed models instead (`DecisionView.read()`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from proxy.admin.openapi import openapi_document
from proxy.decision_base import DecisionKind
from proxy.handoff.decisions import DecisionLog


class DecisionRead(Protocol):
    """A decision (`DecisionView`, read-only) with its plan and outcome as a test indexes them."""

    @property
    def id(self) -> int: ...
    @property
    def at(self) -> float: ...
    @property
    def kind(self) -> DecisionKind: ...
    @property
    def tenant(self) -> str: ...
    @property
    def trigger(self) -> str: ...
    @property
    def plan(self) -> Mapping[str, Any] | None: ...
    @property
    def outcome(self) -> Mapping[str, Any]: ...


def decisions_in(log: DecisionLog, *kinds: DecisionKind, tenant: str | None = None,
                 limit: int = 500) -> list[DecisionRead]:
    """The newest `limit` decisions of `log`, oldest first, of these kinds (every kind when none is
    named) and of `tenant` when one is named. A kind is a `DecisionKind`, so a tenant passed where a
    kind goes (`decisions_in(log, "plan", "ollama")`) fails the type check, not silently the filter."""
    return [d for d in log.recent(limit) if (not kinds or d.kind in kinds) and (tenant is None or d.tenant == tenant)]


def openapi_json(*, token: bool = True) -> dict[str, Any]:
    """The admin API's OpenAPI document (`openapi_document`, every known route), as a test indexes it."""
    return dict(openapi_document(token=token))


__all__ = ["DecisionRead", "decisions_in", "openapi_json"]
