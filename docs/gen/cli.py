"""The command reference, from the argparse parser of proxy/cli.py: each command's synopsis (written
here from the parser's actions, not by argparse's help formatter, whose layout changes between
Python versions and terminal widths), its help and every option."""

from __future__ import annotations

import argparse

from docs.gen.md import code, table
from proxy.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    raise ValueError("proxy/cli.py's parser has no subcommands")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        return action.metavar
    if action.choices:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper()


def _flag(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) if action.option_strings else _metavar(action)
    return f"{names} {_metavar(action)}" if action.option_strings and _takes_value(action) else names


def synopsis(prog: str, parser: argparse.ArgumentParser) -> str:
    parts = [prog]
    for a in _options(parser):
        if not a.option_strings:
            parts.append(_metavar(a))
            continue
        text = a.option_strings[-1] + (f" {_metavar(a)}" if _takes_value(a) else "")
        if isinstance(a, argparse._AppendAction):
            text += " ..."
        parts.append(text if a.required else f"[{text}]")
    return " ".join(parts)


def _default(action: argparse.Action) -> str:
    if not _takes_value(action) or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return code(str(action.default))


def _command(name: str, help_: str, parser: argparse.ArgumentParser) -> str:
    rows = [[code(_flag(a)), "yes" if a.required else "", _default(a), a.help or ""] for a in _options(parser)]
    parts = [f"## `hyperswap {name}`", help_[:1].upper() + help_[1:] + ".",
             "```\n" + synopsis(f"hyperswap {name}", parser) + "\n```"]
    if rows:
        parts.append(table(("option", "required", "default", "meaning"), rows))
    if parser.epilog:
        parts.append(" ".join(parser.epilog.split()))
    return "\n\n".join(parts)


def render() -> str:
    parser = build_parser()
    commands = _subcommands(parser)
    overview = table(("command", "what it does"), [[f"[`{name}`](#hyperswap-{name})", help_]
                                                   for name, help_, _ in commands])
    top = "```\n" + synopsis("hyperswap", parser) + " [OPTIONS]\n```\n\n" + (parser.description or "")
    return "\n\n".join([top, overview, *(_command(name, help_, sub) for name, help_, sub in commands)])
