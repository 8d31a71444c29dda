"""How the simulated Ollama reads a request body: gin's ShouldBindJSON, that is Go's encoding/json
decoding into the handler's request struct (api/types.go, v0.12.3), with Go's error texts.

What Go does and this module follows:
- field names match exactly, else case-insensitively; unknown keys are ignored; null leaves a field
  at its zero value; a repeated key is decoded again (the last one wins);
- a value of the wrong JSON type is an UnmarshalTypeError that is saved and decoding goes on; the
  first one is the answer: `json: cannot unmarshal number into Go struct field
  GenerateRequest.prompt of type string` (Struct = the innermost struct, Field = the full path);
- a type with its own UnmarshalJSON (keep_alive's Duration, think's ThinkValue, each chat Message)
  stops the decoding with its error at once, which wins over a saved type error. A Message decodes
  into a local `Alias` type, and Go (1.24, what v0.12.3 is built with) re-labels its errors with the
  outer context: `... Go struct field ChatRequest.messages.content of type string`;
- only the first JSON value is read: bytes after it are ignored.
Not followed: base64 checks of image strings, the OpenAI-compatible /v1 request structs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.sim.ollama_wire import KeepAliveError, parse_keep_alive

JSON = dict[str, Any]
_INT64 = range(-(2**63), 2**63)
_GO_INT = re.compile(r"-?[0-9]+")


class GoJSONError(ValueError):
    """The error a handler answers with 400 {"error": message}."""


class _Num(str):
    """A JSON number literal, kept as written (Go quotes it in "number 1.5")."""


class _Obj(list[tuple[str, Any]]):
    """A JSON object as its (key, value) pairs in document order, repeats included."""


@dataclass(frozen=True, slots=True)
class _TypeError:
    value: str    # "number", "number 1.5", "string", "bool", "array", "object"
    go_type: str
    struct: str = ""
    path: str = ""

    def text(self) -> str:
        if self.struct or self.path:
            return f"json: cannot unmarshal {self.value} into Go struct field {self.struct}.{self.path} of type {self.go_type}"
        return f"json: cannot unmarshal {self.value} into Go value of type {self.go_type}"


class _Abort(Exception):
    """An UnmarshalJSON error: decoding stops here."""


@dataclass(frozen=True, slots=True)
class Struct:
    name: str                                   # Go's type name, as in "Go struct field <name>.<path>"
    fields: dict[str, Any] = field(default_factory=dict)  # json key -> type spec
    package: str = "api"


@dataclass(frozen=True, slots=True)
class Slice:
    elem: Any
    go_type: str


# A type spec is a Go type name ("string", "bool", "int", "map[string]interface {}", "any"), a Slice,
# a Struct, or a custom decoder (a type with UnmarshalJSON): a callable returning the decoded value
# or raising _Abort.
Custom = Callable[[Any], Any]


def _kind(value: Any) -> str:
    if isinstance(value, _Obj):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, _Num):
        return "number"
    if isinstance(value, bool):
        return "bool"
    return "string"


def _go_name(spec: Any) -> str:
    if isinstance(spec, Struct):
        return f"{spec.package}.{spec.name}"
    if isinstance(spec, Slice):
        return spec.go_type
    return str(spec)


def _plain(value: Any) -> Any:
    """The literal tree as Python's json would have parsed it (the last of repeated keys wins)."""
    if isinstance(value, _Obj):
        return {k: _plain(v) for k, v in value}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, _Num):
        return float(value) if any(c in value for c in ".eE") else int(value)
    return value


def _fits(value: Any, spec: Any) -> bool:
    """Whether a non-null literal can go into a Go scalar of this type."""
    if spec == "string":
        return isinstance(value, str) and not isinstance(value, _Num)
    if spec == "bool":
        return isinstance(value, bool)
    if spec == "map[string]interface {}":
        return isinstance(value, _Obj)
    if spec == "api.ImageData":  # []byte: a base64 string (or an array of bytes)
        return isinstance(value, (str, list)) and not isinstance(value, (_Num, _Obj))
    return isinstance(spec, str) and spec == "any"


class _Decoder:
    """One decode: the first saved type error, and the Go struct the error context is in."""

    def __init__(self) -> None:
        self.saved: _TypeError | None = None

    def save(self, error: _TypeError) -> None:
        if self.saved is None:
            self.saved = error

    def value(self, value: Any, spec: Any, struct: str, path: str) -> Any:
        """Decode one value; returns it canonicalised (struct keys renamed to the Go field's name)."""
        if value is None:
            return None
        if callable(spec):
            return spec(value)
        if isinstance(spec, Struct):
            return self.struct(value, spec, path, struct)
        if isinstance(spec, Slice):
            if not isinstance(value, list) or isinstance(value, _Obj):
                self.save(_TypeError(_kind(value), spec.go_type, struct, path))
                return None
            return [self.value(v, spec.elem, struct, path) for v in value]
        if spec == "int":
            if not isinstance(value, _Num):
                self.save(_TypeError(_kind(value), "int", struct, path))
                return None
            if not _GO_INT.fullmatch(value) or int(value) not in _INT64:
                self.save(_TypeError(f"number {value}", "int", struct, path))
                return None
            return int(value)
        if not _fits(value, spec):
            self.save(_TypeError(_kind(value), _go_name(spec), struct, path))
            return None
        return _plain(value)

    def struct(self, value: Any, spec: Struct, path: str, outer: str = "") -> JSON | None:
        """A JSON object into a Go struct; `outer` is the struct holding it (the error context)."""
        if not isinstance(value, _Obj):
            self.save(_TypeError(_kind(value), _go_name(spec), outer, path))
            return None
        out: JSON = {}
        for key, item in value:
            name = _field(spec, key)
            if name is None:
                continue  # Go ignores keys no field takes
            decoded = self.value(item, spec.fields[name], spec.name, f"{path}.{name}" if path else name)
            if decoded is not None or name not in out:
                out[name] = decoded
        return out


def _field(spec: Struct, key: str) -> str | None:
    """encoding/json's field lookup: the exact name first, else a case-insensitive match."""
    if key in spec.fields:
        return key
    return next((name for name in spec.fields if name.lower() == key.lower()), None)


def _keep_alive(value: Any) -> Any:
    """api.Duration.UnmarshalJSON: Go's time.ParseDuration texts (see ollama_wire.parse_keep_alive)."""
    plain = _plain(value)
    try:
        parse_keep_alive(plain)
    except KeepAliveError as exc:
        raise _Abort(str(exc)) from None
    return plain


def _think(value: Any) -> Any:
    """api.ThinkValue.UnmarshalJSON (v0.12.3): a bool, or "high", "medium" or "low"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and not isinstance(value, _Num):
        if value not in ("high", "medium", "low"):
            raise _Abort(f'invalid think value: {json.dumps(value)} (must be "high", "medium", "low", true, or false)')
        return str(value)
    raise _Abort('think must be a boolean or string ("high", "medium", "low")')


_TOOL_CALL = Struct("ToolCall", {"function": Struct("ToolCallFunction", {
    "index": "int", "name": "string", "arguments": "map[string]interface {}"})})
_MESSAGE_FIELDS = {"role": "string", "content": "string", "thinking": "string",
                   "images": Slice("api.ImageData", "[]api.ImageData"),
                   "tool_calls": Slice(_TOOL_CALL, "[]api.ToolCall"), "tool_name": "string"}


def _message(value: Any) -> JSON:
    """api.Message.UnmarshalJSON: a fresh decode into a local Alias type; its first error is re-labelled
    by the outer decoder (Struct ChatRequest, Field messages.<inner path>) and stops the decoding.
    The role is lower-cased."""
    inner = _Decoder()
    message = inner.struct(value, Struct("Alias", _MESSAGE_FIELDS), "") or {}
    if inner.saved is not None:
        error = inner.saved
        path = f"messages.{error.path}" if error.path else "messages"
        raise _Abort(_TypeError(error.value, error.go_type, "ChatRequest", path).text())
    if isinstance(message.get("role"), str):
        message["role"] = message["role"].lower()
    return message


_TOOL = Struct("Tool", {"type": "string", "items": "any",
                        "function": Struct("ToolFunction", {"name": "string", "description": "string",
                                                            "parameters": "any"})})
_OPTIONS = "map[string]interface {}"

GENERATE = Struct("GenerateRequest", {
    "model": "string", "prompt": "string", "suffix": "string", "system": "string", "template": "string",
    "context": Slice("int", "[]int"), "stream": "bool", "raw": "bool", "format": "any", "keep_alive": _keep_alive,
    "images": Slice("api.ImageData", "[]api.ImageData"), "options": _OPTIONS, "think": _think,
    "_debug_render_only": "bool"})
CHAT = Struct("ChatRequest", {
    "model": "string", "messages": Slice(_message, "[]api.Message"), "stream": "bool", "format": "any",
    "keep_alive": _keep_alive, "tools": Slice(_TOOL, "api.Tools"), "options": _OPTIONS, "think": _think,
    "_debug_render_only": "bool"})
EMBED = Struct("EmbedRequest", {"model": "string", "input": "any", "keep_alive": _keep_alive, "truncate": "bool",
                                "dimensions": "int", "options": _OPTIONS})
EMBEDDING = Struct("EmbeddingRequest", {"model": "string", "prompt": "string", "keep_alive": _keep_alive,
                                        "options": _OPTIONS})
PULL = Struct("PullRequest", {"model": "string", "insecure": "bool", "username": "string", "password": "string",
                              "stream": "bool", "name": "string"})
SHOW = Struct("ShowRequest", {"model": "string", "system": "string", "template": "string", "verbose": "bool",
                              "options": _OPTIONS, "name": "string"})
DELETE = Struct("DeleteRequest", {"model": "string", "name": "string"})
COPY = Struct("CopyRequest", {"source": "string", "destination": "string"})


def _literal_tree(raw: bytes) -> Any:
    """The first JSON value in the body (Go's Decoder reads one value and ignores what follows)."""
    text = raw.decode("utf-8", errors="replace").lstrip(" \t\r\n")
    decoder = json.JSONDecoder(object_pairs_hook=_Obj, parse_int=_Num, parse_float=_Num,
                               parse_constant=_reject_constant)
    value, _ = decoder.raw_decode(text)
    return value


def _reject_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"invalid character '{name[0]}' looking for beginning of value", name, 0)


def decode(raw: bytes, spec: Struct) -> JSON:
    """The request as the handler sees it: the struct's fields by their Go names, with the wrong
    types and failed UnmarshalJSON calls raised as GoJSONError (Go's text). Syntax errors raise
    json.JSONDecodeError; an empty body is the caller's "missing request body"."""
    tree = _literal_tree(raw)
    if tree is None:
        return {}  # null: every field keeps its zero value
    decoder = _Decoder()
    try:
        out = decoder.struct(tree, spec, "")
    except _Abort as exc:
        raise GoJSONError(str(exc)) from None
    if decoder.saved is not None:
        raise GoJSONError(decoder.saved.text())
    return out or {}
