"""The refusals reference, from the typed models of proxy/relay/refusals.py: each refusal's status, when it
is answered, whether it carries `Retry-After`, and its body's fields in the order they go on the wire."""

from __future__ import annotations

from pydantic.fields import FieldInfo

from docs.gen.md import code, table
from proxy.relay.refusals import MODELS, Refusal


def _field(name: str, info: FieldInfo) -> str:
    text = code(name) + ("" if info.is_required() else "?")
    return f"{text} ({info.description})" if info.description else text


def _row(model: type[Refusal], when: str) -> list[str]:
    fields = ", ".join(_field(n, f) for n, f in model.model_fields.items())
    return [code(str(model.status)), code(model.__name__), when, model.retry_after_from or "no", fields]


def render() -> str:
    intro = ("Every refusal a client gets from a tenant's listener or the admin API, one typed model each "
             "(`proxy/relay/refusals.py`). A field marked `?` is there only when it applies; `error` says what "
             "happened and `fix` what to do.")
    return intro + "\n\n" + table(("status", "model", "answered to", "Retry-After", "body"),
                                  [_row(m, when) for m, when in MODELS])
