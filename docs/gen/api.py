"""The admin API reference, from the OpenAPI document the admin listener serves (proxy/admin/openapi.py),
as it reads with a token configured (so the 401 and the token's 403 are listed)."""

from __future__ import annotations

import json
from typing import Any

from docs.gen.md import cell, code, table
from proxy.admin.openapi import Document, openapi_document, responses_of

JSON = dict[str, Any]


def _schema_text(schema: JSON) -> str:
    if "$ref" in schema:
        return code(schema["$ref"].rsplit("/", 1)[-1])
    if "anyOf" in schema:
        return " or ".join(_schema_text(s) for s in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "object" and "properties" in schema:
        return "{" + ", ".join(code(p) for p in schema["properties"]) + "}"
    limits = [f"{k} {schema[k]}" for k in ("minimum", "maximum", "default", "minLength") if k in schema]
    return code(str(kind)) + (f" ({', '.join(limits)})" if limits else "")


def _body_text(answer: JSON) -> str:
    content = answer.get("content", {})
    if not content:
        return ""
    parts = []
    for media, spec in content.items():
        schema = spec.get("schema", {})
        body = _schema_text(schema) if media == "application/json" else ""
        parts.append(f"{media}" + (f" {body}" if body else ""))
    return "; ".join(parts)


def _parameters(op: JSON) -> str:
    params = op.get("parameters", [])
    if not params:
        return ""
    rows = [[code(p["name"]), p["in"], _schema_text(p.get("schema", {})), "yes" if p.get("required") else "no",
             p.get("description", "")] for p in params]
    return table(("parameter", "in", "type", "required", "meaning"), rows)


def _route(path: str, method: str, op: JSON) -> str:
    title = f"### `{method.upper()} {path}`"
    parts = [title, cell(op["summary"]) + "."]
    if op.get("description"):
        parts.append(" ".join(op["description"].split()))
    if op.get("security"):
        parts.append("Needs `Authorization: Bearer <token>` when the admin API has a token.")
    params = _parameters(op)
    if params:
        parts.append(params)
    body = op.get("requestBody")
    if body:
        schema = body["content"]["application/json"]["schema"]
        parts.append(f"Body (JSON): {_schema_text(schema)}, e.g. "
                     f"`{json.dumps({'tenant': 'ollama', 'model': 'gemma3:27b'})}`." if schema.get("required") ==
                     ["tenant", "model"] else f"Body (JSON): {_schema_text(schema)}.")
    rows = [[code(status), answer.get("description", ""), _body_text(answer)]
            for status, answer in sorted(op["responses"].items())]
    parts.append(table(("status", "when", "body"), rows))
    return "\n\n".join(parts)


def statuses(doc: Document) -> str:
    rows = [[code(f"{method.upper()} {path}"), ", ".join(code(s) for s in sorted(responses_of(op)))]
            for path, ops in doc["paths"].items() for method, op in ops.items()]
    return table(("route", "statuses"), rows)


def render() -> str:
    doc = openapi_document(token=True)
    overview = table(("route", "what"), [[code(f"{m.upper()} {p}"), str(op["summary"])]
                                         for p, ops in doc["paths"].items() for m, op in ops.items()])
    routes = "\n\n".join(_route(p, m, op) for p, ops in doc["paths"].items() for m, op in ops.items())
    return "\n\n".join([
        "## Routes\n\n" + overview,
        "## Statuses\n\nEvery answer of every route, as `/openapi.json` describes it. `401`, and the `403` for a "
        "wrong token, come only when a token is configured.\n\n" + statuses(doc),
        "## Each route\n\n" + routes,
    ])
