"""`hyperswap verify`: prove, on this box, that the arbitration works, end to end and through the
proxy's own listeners, the way a client uses it.

The stages are in stages.py, the state and steps they share in session.py; this is their order and runner.
Stages run in order, each bounded by a timeout; a stage whose prerequisite failed is skipped with
the reason. A skipped stage did nothing: each decides to skip before its first effect, and one that
stops after an effect is reported incomplete, with what it did. Nothing that could release a tenant
runs without consent (`--yes`, or a yes at the prompt), no stage loads anything while a tenant is
busy (it waits, bounded, then skips), and what Ollama held when verify started is what it holds at
the end (models verify unloaded are loaded again, models it loaded itself are unloaded).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import httpx

from proxy.verify import stages
from proxy.verify.clients import Unexpected
from proxy.verify.report import Report, StageFailed, StageResult, StageSkipped
from proxy.verify.session import Found, Options, Session

__all__ = ["STAGES", "Found", "Options", "Verify"]

Stage = Callable[[Session], Awaitable[str]]

# In order, after the proxy and its upstreams; restore comes last, when something was changed.
STAGES: tuple[tuple[str, Stage], ...] = (
    ("ollama generation", stages.check_generation),
    ("comfyui graph", stages.check_graph),
    ("reclaim", stages.check_reclaim),
    ("out of memory", stages.check_out_of_memory),
    ("507 too large", stages.check_too_large),
)


class Verify(Session):
    """One run of verify: the proxy and its upstreams first, then STAGES in order, then restore."""

    # -- the runner --------------------------------------------------------------------------------
    async def run(self) -> Report:
        started = self.clock.now()
        if await self.stage("proxy", stages.check_proxy):
            await self._remember_loaded()
            for t in self.found.tenants.values():
                if t.url and t.upstream:
                    await self.stage(f"upstream {t.name}", partial(stages.check_upstream, t=t))
            await self._decide_consent()
            for name, stage in STAGES:
                await self.stage(name, stage)
            if self._restore_needed():
                await self.stage("restore", stages.restore)
        self.report.seconds = self.clock.now() - started
        return self.report

    async def stage(self, name: str, stage: Stage) -> bool:
        """Run one stage under the runner's rules (its timeout, its effects named, never "skipped"
        once it changed something) and add its result to the report; True when it passed."""
        started = self.clock.now()
        timeout = self.options.stage_timeout_s
        self.effects = []
        try:
            async with asyncio.timeout(timeout):
                result = StageResult(name, "pass", 0.0, await stage(self))
        except StageSkipped as s:
            result = StageResult(name, "skip", 0.0, s.reason)
        except StageFailed as f:
            result = StageResult(name, "fail", 0.0, f.detail, f.impact, f.fix)
        except TimeoutError:
            result = StageResult(name, "fail", 0.0, f"did not finish within {timeout:g} s",
                                 "what this stage checks could not be confirmed: the step hangs or the box is very slow",
                                 "run `hyperswap check`; on a slow disk give it longer with --stage-timeout SECONDS")
        except Unexpected as exc:
            result = StageResult(name, "fail", 0.0, str(exc), "this step fails for clients too",
                                 exc.fix() or "see the proxy's log and `hyperswap check`")
        except httpx.HTTPError as exc:
            result = StageResult(name, "fail", 0.0, f"{type(exc).__name__}: {exc}".rstrip(": "),
                                 "this step fails for clients too", "run `hyperswap check` to see which dependency is down")
        except Exception as exc:  # a verify bug must not hide the other stages' results
            result = StageResult(name, "fail", 0.0, f"verify itself failed: {type(exc).__name__}: {exc}",
                                 "this stage's result is unknown", "report it with this output")
        status, detail = result.status, result.detail
        if self.effects and status != "pass":  # a stage that changed something says what, and is never "skipped"
            done = "; ".join(dict.fromkeys(self.effects))
            if status == "skip":
                status, detail = "incomplete", f"did: {done}; then stopped before proving anything: {detail}"
            else:
                detail = f"{detail} (this stage did: {done})"
        result = StageResult(result.name, status, self.clock.now() - started, detail, result.impact, result.fix)
        self.report.stages.append(result)
        if self.on_result:
            self.on_result(result)
        return result.status == "pass"
