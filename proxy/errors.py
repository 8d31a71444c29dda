"""The one exception family. Each carries a user-facing message and a fix hint.

At the HTTP edge an error becomes `{"error": message, "fix": fix, **details}` with its status;
at the CLI edge it becomes one line on stderr and an exit status. Never a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from proxy.encoding import JSONModel, JSONObject


class ErrorBody(JSONModel):
    """Every error answer: a sentence, and a hint where one helps; extra keys give details, in the
    order the error gives them (the admin API's document lists the common ones: `views.Error`)."""
    error: str
    fix: str | None = Field(default=None, description="what to do about it")


def error_body(message: str, fix: str | None = None, details: Mapping[str, object] | None = None) -> JSONObject:
    """An error answer's body, written through `ErrorBody`: the sentence, the fix (none: no key), the details."""
    out = ErrorBody.model_validate({"error": message, **(details or {})})
    if fix:
        out.fix = fix
    return out.dump()


class HyperSwapError(Exception):
    status: int = 500
    exit_code: int = 1

    def __init__(self, message: str, *, fix: str | None = None, status: int | None = None,
                 details: Mapping[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        if status is not None:
            self.status = status
        self.details: dict[str, object] = dict(details or {})

    def body(self) -> JSONObject:
        """The JSON answer at the HTTP edge: `{"error": message, "fix": fix, **details}` (no fix: no key)."""
        return error_body(self.message, self.fix, self.details)

    def one_line(self) -> str:
        return f"error: {self.message}" + (f" (fix: {self.fix})" if self.fix else "")


class ConfigError(HyperSwapError):
    """tenants.json is missing, unreadable, not JSON, or violates the schema."""

    status = 400
    exit_code = 2

    def __init__(self, message: str, *, problems: list[str] | None = None, fix: str | None = None) -> None:
        super().__init__(message, fix=fix, details={"problems": problems or []})
        self.problems = problems or []

    def one_line(self) -> str:
        lines = [f"error: {self.message}"] + [f"  {p}" for p in self.problems]
        if self.fix:
            lines.append(f"fix: {self.fix}")
        return "\n".join(lines)


class UnknownTenant(HyperSwapError):
    status = 404
    exit_code = 2


class McpNotInstalled(HyperSwapError):
    """The MCP tools' SDK is an optional extra (the `mcp` extra: `pip install '.[mcp]'` from the checkout,
    or `pip install 'mcp>=2.3,<3'` into the proxy's environment) and is not installed."""

    status = 501
    exit_code = 2

    def __init__(self) -> None:
        super().__init__("the MCP tools need the optional mcp package, which is not installed",
                         fix="pip install 'mcp>=2.3,<3' into the proxy's environment (or install the checkout "
                             "with its mcp extra: pip install '.[mcp]'); no package index has hyperswap itself")

    @staticmethod
    def caused(exc: ImportError) -> bool:
        """The import failed because the SDK (or a module of it) is missing; any other import error
        is a bug to show, not an extra to suggest."""
        return (exc.name or "").partition(".")[0] == "mcp"
