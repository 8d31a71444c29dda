"""`hyperswap verify`: the end-to-end check of a running proxy and its engines (see runner.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TextIO

import httpx

from proxy.encoding import JSONObject, as_object
from proxy.errors import HyperSwapError
from proxy.tls import client_context
from proxy.verify.report import Report, StageResult, VerifyReport
from proxy.verify.runner import Options, Verify

__all__ = ["Options", "Report", "Verify", "load_graph", "verify_main"]


def load_graph(path: str) -> JSONObject:
    """A ComfyUI graph in API format (Export (API)), bare or as `{"prompt": {...}}` like /prompt's body."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise HyperSwapError(f"cannot read {path}: {exc.strerror}",
                             fix="pass the path of a graph saved with Export (API)") from None
    except json.JSONDecodeError as exc:
        raise HyperSwapError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    graph = data.get("prompt") if isinstance(data, dict) and isinstance(data.get("prompt"), dict) else data
    if not isinstance(graph, dict) or not graph or not all(isinstance(n, dict) and "class_type" in n for n in graph.values()):
        raise HyperSwapError(f"{path} is not a ComfyUI graph in API format (nodes with class_type and inputs)",
                             fix="in ComfyUI use Workflow > Export (API), not the plain Save (that is the UI format)")
    return as_object(graph)


def _ask(question: str) -> bool:
    print(question, end="", file=sys.stderr, flush=True)
    try:
        return input().strip().lower() in ("y", "yes")
    except EOFError:
        return False


async def run_verify(options: Options, *, out: TextIO, err: TextIO, as_json: bool) -> Report:
    def on_result(result: StageResult) -> None:
        if not as_json:
            one = Report(options.admin, [result])
            print(one.text().split("\n\n")[0], file=out, flush=True)

    async with httpx.AsyncClient(timeout=httpx.Timeout(options.stage_timeout_s, connect=5.0), trust_env=False,
                                 verify=client_context()) as http:
        verify = Verify(options, http, ask=_ask, on_result=on_result, say=lambda text: print(text, file=err, flush=True))
        return await verify.run()


def verify_main(admin: str, *, yes: bool, as_json: bool, comfy_graph: str | None, checkpoint: str | None,
                stage_timeout_s: float, busy_wait_s: float = 60.0, out: TextIO | None = None,
                err: TextIO | None = None) -> int:
    """The verdict's exit status: 0 verified, 3 verified without arbitration (no GPU reader), 1 otherwise."""
    out, err = out or sys.stdout, err or sys.stderr
    options = Options(admin=admin, yes=yes, interactive=not as_json and sys.stdin.isatty(),
                      comfy_graph=load_graph(comfy_graph) if comfy_graph else None, comfy_checkpoint=checkpoint,
                      stage_timeout_s=stage_timeout_s, busy_wait_s=busy_wait_s)
    report = asyncio.run(run_verify(options, out=out, err=err, as_json=as_json))
    if as_json:
        print(json.dumps(VerifyReport.of(report).dump(), indent=2), file=out)
    else:
        print(report.text().rsplit("\n", 1)[-1], file=out)
    return report.exit_code
