"""The systemd units HyperSwap ships (package data in proxy/deploy/units/) and the drop-in that moves an engine.

Rendering is text in, text out: `hyperswap install` writes what these return, `--dry-run` prints it,
and the tests run `systemd-analyze verify` on it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from importlib import resources
from typing import Literal

Mode = Literal["system", "user"]
UNIT_NAME = "hyperswap.service"
DROP_IN_NAME = "hyperswap.conf"  # in <service>.d/: a name of our own, so the engine's own drop-ins are untouched
_TEMPLATES: Mapping[Mode, str] = {"system": "hyperswap.service", "user": "hyperswap-user.service"}


def template(mode: Mode) -> str:
    """The shipped unit file, placeholders unfilled."""
    return resources.files("proxy.deploy").joinpath("units", _TEMPLATES[mode]).read_text(encoding="utf-8")


def _quote(word: str) -> str:
    """A word of an Exec= line: systemd splits on spaces and reads C-style quotes, and `%` and `$` are its own."""
    word = word.replace("%", "%%").replace("$", "$$")
    if any(c.isspace() or c in "\"'\\;" for c in word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def render_unit(mode: Mode, exec_argv: list[str], config: str) -> str:
    """The unit with the command that runs `hyperswap` (e.g. ['/usr/local/bin/hyperswap']) and the config path.

    `config` may use systemd specifiers (`%h/.config/hyperswap/tenants.json`): it is not escaped."""
    exec_line = " ".join(_quote(w) for w in exec_argv)
    return template(mode).replace("@EXEC@", exec_line).replace("@CONFIG@", config)


def render_drop_in(environment: Mapping[str, str]) -> str:
    """A `[Service]` drop-in that sets the engine's environment (OLLAMA_HOST=127.0.0.1:11435)."""
    lines = ["# Written by `hyperswap install`: the engine listens here, HyperSwap on its usual port.",
             "# Removed by `hyperswap uninstall`.", "[Service]"]
    for key, value in environment.items():
        assignment = f"{key}={value}".replace("%", "%%")
        lines.append(f"Environment={shlex.quote(assignment) if any(c.isspace() for c in assignment) else assignment}")
    return "\n".join(lines) + "\n"
