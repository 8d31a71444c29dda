"""The Statuses table of the admin API reference (docs/reference/admin-api.md) states every answer
/openapi.json documents, route by route, and every documented error carries an error and a fix."""

from __future__ import annotations

import re
from pathlib import Path

from tests.json_reads import openapi_json

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "admin-api.md"


def page_statuses() -> dict[tuple[str, str], set[str]]:
    """(METHOD, path) -> statuses, from the rows of the `## Statuses` table."""
    text = PAGE.read_text()
    table = text.split("\n## Statuses", 1)[1].split("\n\n", 3)[2]
    out: dict[tuple[str, str], set[str]] = {}
    for row in table.splitlines()[2:]:
        route, statuses = row.strip("|").split("|")[:2]
        codes = set(re.findall(r"`(\d{3})`", statuses))
        for method, path in re.findall(r"`([A-Z]+) ([^`]+)`", route):
            out[(method, path)] = codes
    return out


def test_the_admin_api_page_states_every_status_the_openapi_document_lists() -> None:
    stated = page_statuses()
    doc = openapi_json(token=True)
    missing = {}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            key = (method.upper(), path)
            assert key in stated, f"{method.upper()} {path} has no row in the Statuses table of docs/reference/admin-api.md"
            gap = set(op["responses"]) - stated[key]
            extra = stated[key] - set(op["responses"])
            if gap or extra:
                missing[key] = {"not on the page": sorted(gap), "not in /openapi.json": sorted(extra)}
    assert not missing, missing


def test_every_documented_error_has_an_error_and_a_fix() -> None:
    doc = openapi_json()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, answer in op["responses"].items():
                if not status.startswith(("4", "5")) or "content" not in answer:
                    continue
                ref = answer["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
                props = schemas[ref]["properties"]
                assert {"error", "fix"} <= set(props), f"{method.upper()} {path} {status}: {ref} lacks error or fix"
