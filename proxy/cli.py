"""`hyperswap serve | demo | check | plan | tenants`: the command-line edge.

Errors become one line (or a short list) on stderr and an exit status; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from proxy import __version__
from proxy.config.registry import SETTINGS_SECTIONS, field_value, setting_value
from proxy.engines.loading import load_registry
from proxy.errors import HyperSwapError
from proxy.gpu.visibility import start_notice

if TYPE_CHECKING:
    from proxy.service import Proxy


def cmd_tenants(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    if args.json:
        config = registry.config
        out = {
            "source": str(registry.source) if registry.source else None,
            "settings": {section: {"config": getattr(config, section).model_dump(mode="json"),
                                   "sources": {k.split(".", 1)[1]: v for k, v in registry.settings_provenance.items()
                                               if k.split(".", 1)[0] == section}}
                         for section in SETTINGS_SECTIONS if getattr(config, section) is not None},
            "tenants": {
                name: {"config": t.model_dump(mode="json"), "sources": dict(registry.provenance[name])}
                for name, t in registry.tenants.items()
            },
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"configuration: {registry.source or 'shipped defaults only (no user file)'}")
    section = None
    for dotted, source in registry.settings_provenance.items():
        head = dotted.split(".", 1)[0]
        if head != section:
            section = head
            print(f"\n{section}")
        value = json.dumps(setting_value(registry.config, dotted))
        print(f"  {dotted.split('.', 1)[1]:<28} {value:<48} [{source}]")
    for name, tenant in registry.tenants.items():
        print(f"\n{name}  ({tenant.engine}, priority {tenant.priority}, "
              f"{'reclaimable' if tenant.reclaimable else 'not reclaimable'})")
        for dotted, source in registry.provenance[name].items():
            value = json.dumps(field_value(tenant, dotted))
            print(f"  {dotted:<28} {value:<48} [{source}]")
    return 0


def _log_decisions() -> None:
    """Decisions and releases as one JSON object per line on stderr; never request bodies."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpcore", "mcp", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _log_readable() -> None:
    """The demo's terminal: warnings and the proxy's own notes as short lines; each decision is printed
    as one readable line by the demo itself (proxy.demo.DecisionPrinter), not as JSON."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    for quiet in ("httpx", "httpcore", "mcp", "uvicorn.access", "hyperswap.decisions"):
        logging.getLogger(quiet).setLevel(logging.WARNING)


def cmd_demo(args: argparse.Namespace) -> int:
    from proxy.demo import demo_main
    from proxy.demo_check import self_test

    if args.config is not None and args.no_proxy:
        raise HyperSwapError("--config sets the proxy's settings, and --no-proxy starts no proxy",
                             fix="drop one of them")
    if not args.check:
        (_log_decisions if args.json_logs else _log_readable)()

    return asyncio.run(demo_main(args.scenario, self_test if args.check else None, with_proxy=not args.no_proxy, fast=args.fast,
                                 config=args.config, readable_log=not args.json_logs))


async def serve(proxy: Proxy, stop: asyncio.Event, ports: Mapping[str, int] | None = None, *,
                out: TextIO | None = None, err: TextIO | None = None,
                started: Callable[[], None] | None = None) -> int:
    """Run a built proxy until `stop` is set: its addresses on `out`; on `err`, one line when it
    starts without a GPU reader, saying what works and what does not (never a silent start)."""
    await proxy.start(ports)
    try:
        if started is not None:
            started()
        for name, server in proxy.servers.items():
            print(f"  {name:<12} {server.url}", file=out or sys.stdout, flush=True)
        broker = proxy.broker
        await broker.snapshot()  # the first GPU read: a missing reader is told now, not at the first load
        notice = start_notice(broker.last_snapshot, broker.last_read_error)
        if notice:
            print(notice, file=err or sys.stderr, flush=True)
        await stop.wait()
    finally:
        await proxy.stop()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from proxy.gpu.nvml import NvmlReader
    from proxy.gpu.pods import with_pods
    from proxy.relay.servers import settle_heap
    from proxy.service import Proxy

    registry = load_registry(args.config)
    _log_decisions()

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await serve(Proxy(registry, with_pods(NvmlReader())), stop, started=settle_heap)

    return asyncio.run(run())


def cmd_check(args: argparse.Namespace) -> int:
    from proxy.admin.health import check_main

    if args.ready_within is not None:  # the systemd unit's ExecStartPost gate
        from proxy.deploy.gate import ready_gate

        return ready_gate(args.config, args.admin, args.json, args.ready_within)
    return check_main(args.config, args.admin, args.json)


def cmd_install(args: argparse.Namespace) -> int:
    from proxy.deploy.install import main as deploy_main

    return deploy_main(args, "install")


def cmd_uninstall(args: argparse.Namespace) -> int:
    from proxy.deploy.install import main as deploy_main

    return deploy_main(args, "uninstall")


def cmd_verify(args: argparse.Namespace) -> int:
    from proxy.admin.address import admin_base_url
    from proxy.verify import verify_main

    return verify_main(admin_base_url(args.config, args.admin), yes=args.yes, as_json=args.json, comfy_graph=args.comfy_graph,
                       checkpoint=args.comfy_checkpoint, stage_timeout_s=args.stage_timeout, busy_wait_s=args.busy_wait)


def cmd_mcp(args: argparse.Namespace) -> int:
    from proxy.admin.mcp_extra import load_mcp_tools

    code: int = load_mcp_tools().mcp_main(args.config, args.admin)  # McpNotInstalled: one line, exit 2
    return code


def cmd_plan(args: argparse.Namespace) -> int:
    import httpx

    from proxy.admin.address import admin_base_url

    url = admin_base_url(args.config, args.admin)
    params: dict[str, str] = {"tenant": args.tenant}
    if args.need_gb is not None:
        params["need_gb"] = str(args.need_gb)
    try:
        r = httpx.get(f"{url}/api/plan", params=params, timeout=10, trust_env=False)
    except httpx.HTTPError as exc:
        raise HyperSwapError(f"no proxy answering at {url}: {exc}",
                             fix="start it with `hyperswap serve` (or `hyperswap demo`)") from None
    body = r.json()
    if r.status_code != 200:
        raise HyperSwapError(body.get("error", r.text), fix=body.get("fix"))
    plan = body["plan"]
    if args.json:
        print(json.dumps(body, indent=2))
        return 0 if plan["feasible"] or plan.get("outcome") == "unplanned" else 1
    print(f"{plan.get('outcome') or ('ready' if plan['feasible'] else 'impossible')}: {plan['explanation']}")
    for rel in plan["releases"]:
        print(f"  release {rel['tenant']:<12} ~{rel['expected_free_gib']} GiB  ({rel['reason']})")
    # The requester's own processes are in the plan for its numbers (what it holds counts toward its
    # need); they are not in its way, so they are listed apart, not as blockers.
    for b in plan["blockers"]:
        if b["reason"] == "requester":
            print(f"  held    {b['name']:<20} pid {b['pid']}  {b['tenant']:<10} {b['vram_gib']} GiB  "
                  "(the requester's own: counts toward its need)")
        else:
            print(f"  blocker {b['name']:<20} pid {b['pid']}  {b['tenant']:<10} {b['vram_gib']} GiB  "
                  f"{b['reason']}: {b['detail']}")
    return 0 if plan["feasible"] or plan.get("outcome") == "unplanned" else 1  # unplanned: forwarded as it is


class _ScenarioNames:
    """The demo's scenarios as shipped, listed when `demo --help` is printed (read then: the simulators
    load only for the demo, and the list never goes stale)."""

    def __str__(self) -> str:
        from proxy.demo import scenario_names

        return ", ".join(scenario_names())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperswap", description=(
        "Share one GPU between Ollama, ComfyUI and other local AI apps: a transparent proxy that "
        "reclaims VRAM from idle apps before a load and waits for busy ones."))
    parser.add_argument("--version", action="version", version=f"hyperswap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--config", metavar="PATH", help="tenants.json to use (default: $HYPERSWAP_CONFIG, "
                       "then ~/.config/hyperswap/tenants.json, then the shipped defaults)")
        p.set_defaults(run=run)
        return p

    add("serve", "run the proxy: one listener per tenant plus the admin API", cmd_serve)
    demo = add("demo", "run the proxy against a simulated GPU, Ollama and ComfyUI (no GPU needed)", cmd_demo)
    demo.set_defaults(config=None)
    for action in demo._actions:
        if action.dest == "config":
            action.help = ("a tenants.json whose settings (proxy, admin, telemetry, gpu_profile, tenants) apply over "
                           "the scenario's; the simulated engines keep their simulators as upstream (default: none: "
                           "the demo never reads your tenants.json unless named here)")
    scenario = demo.add_argument("--scenario", default="default",
                                 help="%(scenarios)s, or a scenario file path (default: %(default)s)")
    setattr(scenario, "scenarios", _ScenarioNames())  # noqa: B010 (argparse expands %(scenarios)s from the action)
    demo.add_argument("--check", action="store_true", help="self-test every simulator route and one handoff, then exit 0/1")
    demo.add_argument("--no-proxy", action="store_true", help="start only the simulated GPU box")
    demo.add_argument("--fast", action="store_true",
                      help="cut the simulated engines' load, unload and step times to milliseconds (a quick --check)")
    demo.add_argument("--json-logs", action="store_true",
                      help="log each decision event as one JSON object per line, as `serve` does (default: one "
                      "readable line per decision, so the addresses and Try lines stay on screen)")
    check = add("check", "check every dependency of a running proxy (NVML, upstreams, config) and say how to fix what "
                "is broken; exits 0 when no check failed, 1 when one did, 2 when no proxy answers", cmd_check)
    check.add_argument("--admin", metavar="URL", help="admin API URL (default: from tenants.json)")
    check.add_argument("--json", action="store_true")
    check.add_argument("--ready-within", type=float, metavar="SECONDS",
                       help="wait up to SECONDS for the proxy to answer, print the report, exit 0 once it does "
                       "whatever its dependencies say (2 if it never answers): the service's start gate")
    verify = add("verify", "prove end to end, through a running proxy, that the arbitration works on this box: "
                 "engines, a generation, a graph, a reclaim, out of memory, a 507", cmd_verify)
    verify.add_argument("--admin", metavar="URL", help="admin API URL (default: from tenants.json)")
    verify.add_argument("--yes", action="store_true", help="consent to releasing idle tenants (needed to run "
                        "the reclaim and out-of-memory stages without asking)")
    verify.add_argument("--json", action="store_true", help="machine-readable report")
    verify.add_argument("--comfy-graph", metavar="FILE", help="your ComfyUI graph in API format (default: a minimal "
                        "graph built from the installed nodes)")
    verify.add_argument("--comfy-checkpoint", metavar="NAME",
                        help="the checkpoint of the minimal graph (default: the first listed)")
    verify.add_argument("--stage-timeout", type=float, default=180.0, metavar="SECONDS", help="the most one stage may take")
    verify.add_argument("--busy-wait", type=float, default=60.0, metavar="SECONDS",
                        help="how long a stage that loads anything waits for busy tenants to finish before it is "
                        "skipped (nothing is loaded or queued while a tenant is busy)")
    verify.epilog = ("exit status: 0 verified (every stage that ran passed, the card confirmed it); 3 verified without "
                     "arbitration (no GPU reader: every stage that ran passed, but no release, out of memory or "
                     "refusal could be confirmed on the card); 1 NOT verified (a stage failed, or none passed); "
                     "2 usage or configuration error")
    plan = add("plan", "print a dry-run release plan from a running proxy", cmd_plan)
    plan.add_argument("--tenant", required=True, metavar="NAME", help="the tenant that needs memory")
    plan.add_argument("--need-gb", type=float, help="GiB it needs (default: its needs_vram_gb)")
    plan.add_argument("--admin", metavar="URL", help="admin API URL (default: from tenants.json)")
    plan.add_argument("--json", action="store_true")
    mcp = add("mcp", "serve the MCP tools (health, engines, tenants, plan, release) over stdio for a running proxy", cmd_mcp)
    mcp.add_argument("--admin", metavar="URL", help="admin API URL (default: from tenants.json)")
    from proxy.deploy.install import add_arguments as deploy_arguments

    install = sub.add_parser("install", help="run as a service on the engines' own ports (11434, 8188), the engines "
                             "moved behind it (--dry-run prints every file and command)")
    install.set_defaults(run=cmd_install)
    deploy_arguments(install, "install")
    uninstall = sub.add_parser("uninstall", help="undo `hyperswap install` exactly")
    uninstall.set_defaults(run=cmd_uninstall)
    deploy_arguments(uninstall, "uninstall")
    tenants = add("tenants", "print the merged tenant registry and where each value came from", cmd_tenants)
    tenants.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
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
