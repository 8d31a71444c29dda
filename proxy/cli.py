"""`hyperswap serve | demo | check | plan | tenants`: the command-line edge.

Errors become one line (or a short list) on stderr and an exit status; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from . import __version__
from .errors import HyperSwapError
from .tenants import Registry, field_value, load_registry


def _not_available(command: str, issue: str) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(f"hyperswap {command}: not available yet in {__version__} (arrives with {issue})", file=sys.stderr)
        return 2
    return run


def cmd_tenants(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    if args.json:
        out = {
            "source": str(registry.source) if registry.source else None,
            "tenants": {
                name: {"config": t.model_dump(mode="json"), "sources": dict(registry.provenance[name])}
                for name, t in registry.tenants.items()
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"configuration: {registry.source or 'shipped defaults only (no user file)'}")
    for name, tenant in registry.tenants.items():
        print(f"\n{name}  ({tenant.engine}, priority {tenant.priority}, "
              f"{'reclaimable' if tenant.reclaimable else 'not reclaimable'})")
        for dotted, source in registry.provenance[name].items():
            value = json.dumps(field_value(tenant, dotted))
            print(f"  {dotted:<28} {value:<48} [{source}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperswap", description=(
        "Share one GPU between Ollama, ComfyUI and other local AI apps: a transparent proxy that "
        "reclaims VRAM from idle, lower-priority apps before a load."))
    parser.add_argument("--version", action="version", version=f"hyperswap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--config", metavar="PATH", help="tenants.json to use (default: $HYPERSWAP_CONFIG, "
                       "then ~/.config/hyperswap/tenants.json, then the shipped defaults)")
        p.set_defaults(run=run)
        return p

    add("serve", "run the proxy: one listener per tenant plus the admin API", _not_available("serve", "the forwarding issue"))
    add("demo", "run the proxy against a simulated GPU, Ollama and ComfyUI", _not_available("demo", "the simulator issue"))
    add("check", "check every dependency (NVML, upstreams, config) and say how to fix what is broken",
        _not_available("check", "the self-knowledge issue"))
    plan = add("plan", "print a dry-run release plan from a running proxy", _not_available("plan", "the arbitration issue"))
    plan.add_argument("--tenant")
    plan.add_argument("--need-gb", type=float)
    tenants = add("tenants", "print the merged tenant registry and where each value came from", cmd_tenants)
    tenants.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except HyperSwapError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `hyperswap tenants | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
