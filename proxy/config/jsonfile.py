"""Reading tenants.json: what JSON allows but a configuration must not hold (a key named twice,
NaN or Infinity, nesting too deep) is found with its path instead of silently kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

from proxy.config.messages import schema_error
from proxy.errors import ConfigError

MAX_DEPTH = 32  # JSON nesting; release.body is the only free-form part and needs a few levels


class _RepeatedKeys(dict[str, object]):
    """A JSON object that named a key twice (json keeps the last silently; we refuse it)."""

    repeated: list[str]


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    repeated: list[str] = []
    for key, value in pairs:
        if key in out:
            repeated.append(key)
        out[key] = value
    if not repeated:
        return out
    marked = _RepeatedKeys(out)
    marked.repeated = repeated
    return marked


def read_json(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist",
                          fix="create it, or drop --config / HYPERSWAP_CONFIG to use the shipped defaults") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        return json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}",
                          fix="fix the JSON at that line and column") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to read",
                          fix=f"a tenants.json needs a few levels; keep it under {MAX_DEPTH}") from None
    except ValueError as exc:  # an integer literal of thousands of digits
        raise ConfigError(f"{path}: a number cannot be read: {exc}", fix="write numbers of a sensible size") from None


def _non_finite(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def tree_problems(data: object) -> tuple[list[str], bool]:
    """What JSON allows but a configuration must not hold, each with its path: a key given twice,
    NaN or Infinity (also a literal too large for a float), nesting deeper than MAX_DEPTH. Also
    whether anything was too deep to go on with. Iterative: a deep document cannot overflow the stack."""
    problems: list[str] = []
    too_deep = False
    stack: list[tuple[tuple[str, ...], object]] = [((), data)]
    while stack:
        path, value = stack.pop()
        where = ".".join(path) or "(top level)"
        if len(path) > MAX_DEPTH:
            problems.append(f"{where}: nested deeper than {MAX_DEPTH} levels")
            too_deep = True
            continue
        if isinstance(value, _RepeatedKeys):
            problems += [f"{where}: key {key!r} twice (JSON would silently keep the last one): remove one"
                         for key in dict.fromkeys(value.repeated)]
        if isinstance(value, float) and not math.isfinite(value):
            why = "" if math.isnan(value) else " (a literal too large for a float reads as Infinity)"
            problems.append(f"{where}: {_non_finite(value)} is not a number a configuration can use{why}: "
                            "write a finite number")
        elif isinstance(value, dict):
            stack += [((*path, str(k)), v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [((*path, str(i)), v) for i, v in reversed(list(enumerate(value)))]
    return problems, too_deep


def check_tree(data: object, where: str) -> list[str]:
    """The tree's problems, to be listed with the schema's; raised at once when merging and
    validating would recurse too deep."""
    problems, too_deep = tree_problems(data)
    if too_deep:
        raise schema_error(where, problems)
    return problems
