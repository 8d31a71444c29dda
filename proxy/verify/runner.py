"""`hyperswap verify`: prove, on this box, that the arbitration works, end to end and through the
proxy's own listeners, the way a client uses it.

Stages run in order, each bounded by a timeout; a stage whose prerequisite failed is skipped with
the reason. Nothing that could release a tenant runs without consent (`--yes`, or a yes at the
prompt), nothing runs while a tenant is busy, and Ollama models that verify unloaded are loaded
again at the end (models it loaded itself are unloaded).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.clock import Clock, SystemClock
from proxy.tenants import GIB
from proxy.verify.clients import (
    AdminClient,
    ComfyClient,
    GraphRun,
    OllamaClient,
    OllamaModel,
    TenantInfo,
    Unexpected,
    WsConnect,
    default_ws_connect,
    gib,
    graph_checkpoint,
    minimal_graph,
)
from proxy.verify.report import Report, StageFailed, StageResult, StageSkipped

# The path that proves an engine answers (through the proxy): what each engine kind serves cheaply.
PROBE_PATHS: Mapping[str, str] = {"ollama": "/api/version", "comfyui": "/system_stats"}
# The engine kinds whose wire verify speaks for the generation, graph, reclaim and OOM stages.
GENERATES, RENDERS = "ollama", "comfyui"


@dataclass(slots=True)
class Options:
    admin: str
    yes: bool = False
    interactive: bool = False  # may ask on the terminal; else no --yes means no consent
    comfy_graph: dict[str, Any] | None = None
    comfy_checkpoint: str | None = None
    stage_timeout_s: float = 180.0


Ask = Callable[[str], bool]
Stage = Callable[[], Awaitable[str]]


@dataclass(slots=True)
class _Found:
    """What earlier stages learnt that later ones build on."""
    tenants: dict[str, TenantInfo] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    ollama_before: dict[str, int] | None = None
    loaded_by_us: set[str] = field(default_factory=set)
    released_comfy: bool = False
    graph: dict[str, Any] | None = None
    graph_ckpt: str | None = None
    graph_held: int | None = None  # what the render tenant held right after the graph


class _NoCandidate(Exception):
    """This direction of the reclaim cannot be staged with what is installed; the reason says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _fails(exc: Unexpected, what: str, impact: str, fix: str) -> StageFailed:
    return StageFailed(f"{what}: {exc}", impact=impact, fix=exc.fix() or fix)


class Verify:
    def __init__(self, options: Options, http: httpx.AsyncClient, *, ws: WsConnect = default_ws_connect,
                 clock: Clock | None = None, ask: Ask | None = None,
                 on_result: Callable[[StageResult], None] | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.http = http
        self.ws = ws
        self.clock = clock or SystemClock()
        self.ask = ask
        self.on_result = on_result
        self.say = say or (lambda text: None)
        self.admin = AdminClient(options.admin, http)
        self.found = _Found()
        self.consent = False
        self.report = Report(options.admin)

    # -- the runner --------------------------------------------------------------------------------
    async def run(self) -> Report:
        started = self.clock.now()
        if await self._stage("proxy", self.stage_proxy):
            for t in self.found.tenants.values():
                if t.url and t.upstream:
                    await self._stage(f"upstream {t.name}", lambda t=t: self.stage_upstream(t))  # type: ignore[misc]
            await self._decide_consent()
            await self._stage("ollama generation", self.stage_generation)
            await self._stage("comfyui graph", self.stage_graph)
            await self._stage("reclaim", self.stage_reclaim)
            await self._stage("out of memory", self.stage_oom)
            await self._stage("507 too large", self.stage_too_large)
            if self._restore_needed():
                await self._stage("restore", self.stage_restore)
        self.report.seconds = self.clock.now() - started
        return self.report

    async def _stage(self, name: str, fn: Stage) -> bool:
        started = self.clock.now()
        timeout = self.options.stage_timeout_s
        try:
            async with asyncio.timeout(timeout):
                result = StageResult(name, "pass", 0.0, await fn())
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
        result = StageResult(result.name, result.status, self.clock.now() - started, result.detail, result.impact, result.fix)
        self.report.stages.append(result)
        if self.on_result:
            self.on_result(result)
        return result.status == "pass"

    # -- helpers -----------------------------------------------------------------------------------
    def _tenant(self, kind: str) -> TenantInfo:
        """The first tenant of an engine kind that clients reach through a listener, and that answered."""
        t = next((t for t in self.found.tenants.values() if t.engine == kind and t.url), None)
        if t is None:
            raise StageSkipped(f"no {kind} tenant with a listener in this proxy's configuration")
        if t.name in self.found.unreachable:
            raise StageSkipped(f"{t.name} is not reachable through the proxy (see upstream {t.name})")
        return t

    def _ollama(self, t: TenantInfo) -> OllamaClient:
        assert t.url
        return OllamaClient(t.url, self.http)

    def _comfy(self, t: TenantInfo) -> ComfyClient:
        assert t.url
        return ComfyClient(t.url, self.http, self.ws, self.clock)

    def _need_consent(self, what: str) -> None:
        if not self.consent:
            raise StageSkipped(f"{what}: it releases tenants, so it needs consent (run with --yes)")

    async def _nobody_busy(self) -> None:
        busy = [t for t in await self.admin.tenants() if t.busy]
        if busy:
            who = ", ".join(f"{t.name} ({t.busy_reason})" for t in busy)
            raise StageSkipped(f"{who} busy: verify never disturbs running work; run it again when the box is idle")

    async def _plan_allows(self, tenant: TenantInfo, need: int | None, what: str) -> dict[str, Any]:
        """The proxy's own dry-run for this load: refused loads fail here, and a load that would
        release someone runs only with consent."""
        plan = await self.admin.plan(tenant.name, need)
        if not plan.get("possible", plan.get("feasible")):
            raise StageFailed(f"{what} cannot be loaded on this card: {plan.get('explanation')}",
                              impact=f"{tenant.name} answers 507 to it through the proxy",
                              fix="use a smaller model, or free the memory the plan's blockers hold")
        names = [r["tenant"] for r in plan.get("releases") or []]
        if names and not self.consent:
            raise StageSkipped(f"loading {what} would release {', '.join(names)}: that needs consent (run with --yes)")
        return plan

    async def _generation_models(self, client: OllamaClient) -> list[OllamaModel]:
        models = [m for m in await client.models() if await client.can_generate(m.name)]
        if not models:
            raise StageSkipped("no installed Ollama model can generate text (`ollama pull llama3.2:1b` adds a small one)")
        return models

    async def _decisions_after(self, after_id: int, tenant: str) -> list[dict[str, Any]]:
        return [d for d in await self.admin.decisions() if d["id"] > after_id and d["tenant"] == tenant]

    async def _last_decision_id(self) -> int:
        return max((int(d["id"]) for d in await self.admin.decisions(1)), default=0)

    # -- consent -----------------------------------------------------------------------------------
    async def _decide_consent(self) -> None:
        held = [t for t in self.found.tenants.values() if t.reclaimable
                and (t.vram_bytes or 0) > int(float(t.config.get("idle_vram_gb") or 0) * GIB)]
        ollama = next((t for t in self.found.tenants.values() if t.engine == GENERATES and t.url
                       and t.name not in self.found.unreachable), None)
        if ollama is not None:
            try:
                self.found.ollama_before = await self._ollama(ollama).loaded()
            except (httpx.HTTPError, Unexpected, ValueError):
                self.found.ollama_before = None
        if self.options.yes:
            self.consent = True
            return
        models = ", ".join(self.found.ollama_before or {})
        text = ("verify loads a small model and a small graph, then makes the proxy release idle tenants to prove the "
                "handoff (" + (", ".join(f"{t.name} holds {gib(t.vram_bytes)}" for t in held) or "nobody holds memory now")
                + ")." + (f" The Ollama models loaded now ({models}) are loaded again at the end." if models else "")
                + " ComfyUI loads its checkpoint again on its next prompt. Busy tenants are never touched.")
        self.say(text)
        if self.options.interactive and self.ask is not None:
            self.consent = await asyncio.to_thread(self.ask, "Go ahead? [y/N] ")
        self.say("consent given" if self.consent else
                 "no consent: stages that release a tenant are skipped (run with --yes to include them)")

    # -- stages ------------------------------------------------------------------------------------
    async def stage_proxy(self) -> str:
        try:
            tenants = await self.admin.tenants()
            stats = await self.admin.stats()
        except (httpx.HTTPError, Unexpected, ValueError, KeyError) as exc:
            raise StageFailed(f"no HyperSwap admin API answers at {self.admin.base}: {type(exc).__name__}: {exc}",
                              impact="nothing can be verified: clients reach no proxy, so nothing arbitrates the GPU",
                              fix="start it with `hyperswap serve` (or `hyperswap demo`), or pass --admin URL") from None
        self.found.tenants = {t.name: t for t in tenants}
        self.found.device = stats.get("device") or {}
        dev = self.found.device
        gpu_note = "" if stats.get("gpu_error") is None else f"; GPU reader: {stats['gpu_error'].get('error')}"
        return (f"admin API at {self.admin.base}: {len(tenants)} tenant(s) ({', '.join(self.found.tenants)}), "
                f"GPU {dev.get('name')} {gib(dev.get('total_bytes'))} ({dev.get('source')}){gpu_note}")

    async def stage_upstream(self, t: TenantInfo) -> str:
        assert t.url
        path = PROBE_PATHS.get(t.engine, "/")
        impact = f"clients of {t.name} at {t.url} get errors, and the proxy cannot ask {t.name} for memory back"
        try:
            r = await self.http.get(t.url + path)
        except httpx.HTTPError as exc:
            self.found.unreachable[t.name] = "listener"
            raise StageFailed(f"the proxy's listener for {t.name} does not answer at {t.url}: {type(exc).__name__}",
                              impact=impact, fix=f"check tenants.{t.name}.listen and restart `hyperswap serve`") from None
        ok = r.status_code < 500 if t.engine not in PROBE_PATHS else r.status_code == 200
        if not ok:
            self.found.unreachable[t.name] = "upstream"
            answer = Unexpected(f"GET {path} through {t.url}", r)
            raise StageFailed(f"{t.name} ({t.upstream}) is not answering through the proxy: {answer}", impact=impact,
                              fix=answer.fix() or f"start {t.name}, or correct tenants.{t.name}.upstream ({t.upstream})")
        return f"{t.url}{path} -> {t.upstream}: {r.status_code}"

    async def stage_generation(self) -> str:
        t = self._tenant(GENERATES)
        client = self._ollama(t)
        model = (await self._generation_models(client))[0]
        plan = await self._plan_allows(t, model.size + t.context_allowance_bytes, model.name)
        started = self.clock.now()
        body = await self._generate(t, client, model)
        released = ", ".join(r["tenant"] for r in plan.get("releases") or [])
        return (f"{model.name} ({gib(model.size)}, the smallest installed) answered {body.get('eval_count', '?')} token(s) "
                f"through {t.url} in {self.clock.now() - started:.2f} s" + (f", after releasing {released}" if released else ""))

    async def _generate(self, t: TenantInfo, client: OllamaClient, model: OllamaModel) -> dict[str, Any]:
        try:
            body = await client.generate(model.name)
        except Unexpected as exc:
            if exc.status == 507:
                raise _fails(exc, f"the proxy refused {model.name}", f"{model.name} cannot run on this card through the proxy",
                             "use a smaller model or quantisation") from None
            if "out of memory" in exc.error_text().lower():
                raise _fails(exc, f"{model.name} ran out of GPU memory", "generations fail although the proxy made room",
                             f"raise tenants.{t.name}.context_allowance_gb (what a model needs beyond its file size)") from None
            raise _fails(exc, f"generation with {model.name} failed", f"{t.name}'s clients get this error too",
                         f"see {t.name}'s own log; `hyperswap check`") from None
        if not (self.found.ollama_before or {}).get(model.name):
            self.found.loaded_by_us.add(model.name)
        return body

    async def _graph(self, t: TenantInfo) -> tuple[dict[str, Any], str | None, str]:
        if self.options.comfy_graph is not None:
            return self.options.comfy_graph, graph_checkpoint(self.options.comfy_graph), "your"
        info = await self._comfy(t).object_info()
        try:
            graph, ckpt = minimal_graph(info, self.options.comfy_checkpoint, random.randrange(1 << 31))
        except LookupError as exc:
            raise StageSkipped(f"{exc}: pass a graph of your own with --comfy-graph FILE (ComfyUI: Export (API))") from None
        return graph, ckpt, "a minimal"

    async def _run_graph(self, t: TenantInfo) -> tuple[GraphRun, str | None, str]:
        graph, ckpt, whose = await self._graph(t)
        try:
            run = await self._comfy(t).run(graph)
        except Unexpected as exc:
            raise _fails(exc, f"{whose} graph was refused", f"{t.name} prompts through the proxy fail",
                         "check the graph in ComfyUI's own UI (missing models or nodes show there)") from None
        if run.ok:  # later stages run this graph again
            self.found.graph, self.found.graph_ckpt = graph, ckpt
        return run, ckpt, whose

    async def stage_graph(self) -> str:
        t = self._tenant(RENDERS)
        await self._plan_allows(t, None, f"a {t.name} graph")
        run, ckpt, whose = await self._run_graph(t)
        if not run.ok:
            raise StageFailed(f"{whose} graph ({ckpt}) ended with {run.error_type}: {run.error}",
                              impact=f"{t.name} prompts through the proxy fail",
                              fix=(f"raise tenants.{t.name}.needs_vram_gb: the proxy made less room than the graph takes"
                                   if run.error_type and "OutOfMemory" in run.error_type
                                   else f"run the graph in {t.name}'s own UI and read its log"))
        held = (await self.admin.tenant(t.name)).vram_bytes
        self.found.graph_held = held
        return (f"{whose} graph ({ckpt or 'no checkpoint'}) ran through {t.url}, followed by {run.followed}; "
                f"{t.name} holds {gib(held)} after it")

    async def stage_reclaim(self) -> str:
        """One tenant needs memory another holds idle: ComfyUI holds a checkpoint and an Ollama model
        needs it, else (no model that large) Ollama holds a model and the ComfyUI graph needs it."""
        self._need_consent("reclaim")
        comfy_t, ollama_t = self._tenant(RENDERS), self._tenant(GENERATES)
        if self.found.graph is None:
            raise StageSkipped(f"the {comfy_t.name} graph did not run, so the handoff cannot be staged")
        await self._nobody_busy()
        try:
            return await self._reclaim_for_generation(comfy_t, ollama_t)
        except _NoCandidate as first:
            try:
                return await self._reclaim_for_graph(comfy_t, ollama_t)
            except _NoCandidate as second:
                raise StageSkipped(f"{first.reason}; and {second.reason}") from None

    async def _reclaim_for_generation(self, holder_t: TenantInfo, needer_t: TenantInfo) -> str:
        # A fresh graph right before: the holder's idle timer starts again and cannot free it mid-stage.
        run, _, _ = await self._run_graph(holder_t)
        if not run.ok:
            raise StageFailed(f"the graph before the reclaim failed: {run.error_type}: {run.error}",
                              impact=f"{holder_t.name} prompts through the proxy fail", fix=f"see {holder_t.name}'s log")
        holder = await self._holder(holder_t.name)
        client = self._ollama(needer_t)
        chosen: tuple[OllamaModel, dict[str, Any]] | None = None
        for model in await self._generation_models(client):
            plan = await self.admin.plan(needer_t.name, model.size + needer_t.context_allowance_bytes)
            if plan.get("feasible") and holder.name in [r["tenant"] for r in plan.get("releases") or []]:
                chosen = (model, plan)
                break
        if chosen is None:
            raise _NoCandidate(f"no installed {needer_t.name} model needs the {gib(holder.vram_bytes)} {holder.name} "
                               "holds (each fits beside it, or not on this card at all)")
        model, plan = chosen
        self.say(f"reclaim: loading {model.name} makes the proxy release {holder.name} ({gib(holder.vram_bytes)})")
        mark = await self._last_decision_id()
        started = self.clock.now()
        await self._generate(needer_t, client, model)
        took = self.clock.now() - started
        self.found.released_comfy = True
        after, release = await self._confirm_release(needer_t.name, holder, mark, model.name)
        on_gpu = (await client.loaded()).get(model.name, 0)
        if on_gpu <= 0:
            raise StageFailed(f"{model.name} is not on the GPU after {holder.name}'s release",
                              impact=f"{model.name} runs from the CPU or not at all",
                              fix=f"see GET /api/decisions and {needer_t.name}'s log")
        return (f"{model.name} needed {gib(plan['need_bytes'])}: the proxy released {holder.name} "
                f"({gib(holder.vram_bytes)} -> {gib(after)} on the card, {release.get('duration_s')} s) and "
                f"{model.name} loaded ({gib(on_gpu)} on the GPU) in {took:.2f} s")

    async def _reclaim_for_graph(self, needer_t: TenantInfo, holder_t: TenantInfo) -> str:
        try:  # ComfyUI down to its floor, so its graph has to load again and needs the card
            await self.admin.release(needer_t.name)
        except Unexpected as exc:
            raise _fails(exc, f"{needer_t.name} could not be released to stage the handoff",
                         f"loads that need {needer_t.name}'s idle memory wait for its release, then fail",
                         f"see GET /api/tenants/{needer_t.name}") from None
        self.found.released_comfy = True
        client = self._ollama(holder_t)
        # The largest model that loads without anyone released (its own eviction aside)...
        model = None
        for m in sorted(await self._generation_models(client), key=lambda m: -m.size):
            plan = await self.admin.plan(holder_t.name, m.size + holder_t.context_allowance_bytes)
            if plan.get("feasible") and not plan.get("releases"):
                model = m
                break
        if model is None:
            raise _NoCandidate(f"no installed {holder_t.name} model loads beside {needer_t.name} without a release")
        # ...loaded right before, so Ollama's own keep-alive timer is fresh and cannot free it mid-stage.
        await self._generate(holder_t, client, model)
        graph_plan = await self.admin.plan(needer_t.name)
        if holder_t.name not in [r["tenant"] for r in graph_plan.get("releases") or []]:
            raise _NoCandidate(f"with {model.name} on the card a {needer_t.name} graph still fits "
                               f"({graph_plan.get('explanation')})")
        holder = await self._holder(holder_t.name)
        self.say(f"reclaim: the {needer_t.name} graph makes the proxy release {holder.name} ({gib(holder.vram_bytes)})")
        mark = await self._last_decision_id()
        started = self.clock.now()
        run, ckpt, _ = await self._run_graph(needer_t)
        took = self.clock.now() - started
        if not run.ok:
            raise StageFailed(f"the graph after {holder.name}'s release failed: {run.error_type}: {run.error}",
                              impact=f"{needer_t.name} prompts fail although the proxy made room",
                              fix=f"raise tenants.{needer_t.name}.needs_vram_gb to what its graphs take")
        after, release = await self._confirm_release(needer_t.name, holder, mark, f"the {ckpt} graph")
        now = (await self.admin.tenant(needer_t.name)).vram_bytes
        return (f"a {needer_t.name} graph needed {gib(graph_plan['need_bytes'])} while {model.name} held the card: the "
                f"proxy released {holder.name} ({gib(holder.vram_bytes)} -> {gib(after)} on the card, "
                f"{release.get('duration_s')} s) and the {ckpt} graph ran ({needer_t.name} holds {gib(now)}) in {took:.2f} s")

    async def _holder(self, name: str) -> TenantInfo:
        holder = await self.admin.tenant(name)
        if holder.vram_bytes is None:
            raise StageSkipped(f"what {name} holds cannot be seen (no GPU reader): a release cannot be confirmed")
        if holder.idle_release_in_s is not None and holder.idle_release_in_s < self.options.stage_timeout_s:
            raise StageSkipped(f"{name}'s idle timer frees it in {holder.idle_release_in_s:g} s, within this "
                               "stage's time: its release could not be told from the timer's (raise "
                               f"tenants.{name}.idle_release_after_s above {self.options.stage_timeout_s:g} s)")
        return holder

    async def _confirm_release(self, requester: str, holder: TenantInfo, mark: int, what: str) -> tuple[int, dict[str, Any]]:
        """The proxy's plan for the load released the holder, and the card shows its memory back."""
        assert holder.vram_bytes is not None
        after = (await self.admin.tenant(holder.name)).vram_bytes or 0
        releases = [r for d in await self._decisions_after(mark, requester) if d["kind"] == "plan"
                    for r in d["outcome"].get("releases") or [] if r.get("tenant") == holder.name]
        impact = (f"loads that need {holder.name}'s idle memory wait for the release timeout, then spill to the CPU "
                  "or run out of memory")
        if not releases:
            raise StageFailed(f"{what} loaded but the proxy's decisions show no release of {holder.name}",
                              impact=impact, fix="see GET /api/decisions; report it with this output")
        reclaimable = holder.vram_bytes - int(float(holder.config.get("idle_vram_gb") or 0) * GIB)
        freed = holder.vram_bytes - after
        last = releases[-1]
        if last.get("estimated") and not last.get("error"):
            # No GPU reader: the engines' own reports say the handoff happened; the card cannot say so.
            raise StageSkipped(f"{what} loaded after the proxy released {holder.name} ({gib(holder.vram_bytes)} -> "
                               f"{gib(after)} by its own report), but without a GPU reader the card cannot confirm the "
                               "release: fix the GPU reader (`hyperswap check`) to verify it")
        if not last.get("confirmed") or freed < reclaimable / 2:
            raise StageFailed(
                f"{holder.name}'s release never showed on the card: it held {gib(holder.vram_bytes)}, holds {gib(after)} "
                f"now ({last.get('error') or 'not confirmed'})", impact=impact,
                fix=(f"see GET /api/tenants/{holder.name} and {holder.name}'s log: an engine that answers its release "
                     f"but keeps the memory needs a stronger release (release.free_memory), or give it longer "
                     f"(tenants.{holder.name}.release_timeout_s)"))
        return after, last

    async def stage_oom(self) -> str:
        self._need_consent("out of memory")
        comfy_t, ollama_t = self._tenant(RENDERS), self._tenant(GENERATES)
        ckpt, held = self.found.graph_ckpt, self.found.graph_held
        if self.found.graph is None or held is None:
            raise StageSkipped(f"the {comfy_t.name} graph did not run, so its footprint is unknown")
        await self._nobody_busy()
        declared_gb = (comfy_t.config.get("model_vram_gb") or {}).get(ckpt or "")
        declared = int(float(declared_gb) * GIB) if declared_gb is not None else comfy_t.needs_vram_bytes
        # Before touching anything: the proxy makes `declared` less what ComfyUI holds free for a graph,
        # and the graph loads `held` less the same floor, so a window exists only if held > declared.
        if held <= declared:
            raise StageSkipped(f"the proxy plans {gib(declared)} for a {comfy_t.name} graph, at least the {gib(held)} the "
                               f"{ckpt} graph took: it cannot run out of memory through the proxy, so no out-of-memory "
                               "can be provoked safely (the retry is covered by the tests on a simulated box)")
        stats = await self.admin.stats()
        await self._free_after(ollama_t, stats)  # skips now, before unloading anything, without a GPU reader
        client = self._ollama(ollama_t)
        models = await self._generation_models(client)
        floor_guess = min(held, int(float(comfy_t.config.get("idle_vram_gb") or 0) * GIB))
        ollama_now = (await self.admin.tenant(ollama_t.name)).vram_bytes or 0
        comfy_now = (await self.admin.tenant(comfy_t.name)).vram_bytes or 0
        free_guess = int(stats["device"]["free_bytes"]) + ollama_now + max(0, comfy_now - floor_guess)
        lo, hi = declared - floor_guess, held - floor_guess
        if not [m for m in models if lo <= free_guess - m.size < hi]:
            raise StageSkipped(f"no installed {ollama_t.name} model leaves free memory between {gib(lo)} and {gib(hi)} "
                               f"(about {gib(free_guess)} free with both emptied): an out-of-memory cannot be staged safely")
        for name in await client.loaded():  # the window is measured with Ollama empty
            await client.unload(name)
        await self._wait_empty(ollama_t.name)
        try:
            await self.admin.release(comfy_t.name)  # its checkpoint off the card: the graph loads it again
        except Unexpected as exc:
            raise _fails(exc, f"{comfy_t.name} could not be released to stage the out-of-memory",
                         f"loads that need {comfy_t.name}'s idle memory wait for its release, then fail",
                         f"see GET /api/tenants/{comfy_t.name}") from None
        self.found.released_comfy = True
        floor = (await self.admin.tenant(comfy_t.name)).vram_bytes or 0
        free = await self._free_after(ollama_t)
        # Free memory between what the proxy plans for and what the graph really loads: the proxy sees
        # room, the engine runs out, and only ComfyUI's own allocation fails (it unloads and reports).
        lo, hi = declared - floor, held - floor
        fits = [m for m in models if lo <= free - m.size < hi]
        if not fits:
            raise StageSkipped(f"no installed {ollama_t.name} model leaves free memory between {gib(lo)} and {gib(hi)} "
                               f"({gib(free)} free now): an out-of-memory cannot be staged safely")
        model = min(fits, key=lambda m: abs(free - m.size - (lo + hi) / 2))
        self.say(f"out of memory: {model.name} fills the card so the {ckpt} graph cannot load beside it")
        await self._generate(ollama_t, client, model)
        free = await self._free_after(ollama_t)
        if not lo <= free < hi:
            raise StageSkipped(f"with {model.name} loaded {gib(free)} is free, outside {gib(lo)}..{gib(hi)}: not staged")
        mark = await self._last_decision_id()
        graph = self.found.graph
        run = await self._comfy(comfy_t).run(graph)
        if run.ok:
            raise StageSkipped(f"{comfy_t.name} ran the graph in {gib(free)} without running out of memory (it may load "
                               "part of a model at a time): the out-of-memory path was not reached")
        if not run.error_type or "OutOfMemory" not in run.error_type:
            raise StageFailed(f"the graph failed with {run.error_type}: {run.error}", impact=f"{comfy_t.name} prompts fail",
                              fix=f"see {comfy_t.name}'s log")
        retry = await self._oom_retry(comfy_t.name, mark, run.prompt_id)
        outcome = retry["outcome"]
        if outcome.get("oom_retry") != "requeued" or not outcome.get("requeued_as"):
            raise StageFailed(f"{comfy_t.name} ran out of memory and the proxy did not retry: {outcome.get('oom_retry')}",
                              impact="a prompt that runs out of memory fails although idle tenants hold memory",
                              fix=f"see GET /api/decisions (decision {retry['id']}) and the proxy's log")
        again = await self._comfy(comfy_t).wait_history(str(outcome["requeued_as"]))
        if not again.ok:
            raise StageFailed(f"the retried prompt {again.prompt_id} failed too: {again.error_type}: {again.error}",
                              impact="a prompt that runs out of memory fails even after the proxy made room",
                              fix=f"raise tenants.{comfy_t.name}.needs_vram_gb to what its graphs take")
        released = ", ".join(f"{r['tenant']} ({r.get('freed_gb')} GiB)" for r in outcome.get("releases") or [])
        return (f"with {model.name} on the card ({gib(free)} free), the {ckpt} graph ran out of memory in "
                f"{comfy_t.name}; the proxy released {released or 'nobody'} and re-queued it as {again.prompt_id}, "
                "which succeeded")

    async def _wait_empty(self, tenant: str) -> None:
        """An unload answers before the memory is back; the card says when it is (bounded by the stage)."""
        while (await self.admin.tenant(tenant)).vram_bytes:
            await self.clock.sleep(0.1)

    async def _free_after(self, tenant: TenantInfo, stats: Mapping[str, Any] | None = None) -> int:
        device = (stats if stats is not None else await self.admin.stats()).get("device") or {}
        free = device.get("free_bytes")
        if free is None or device.get("source") == "engine-estimate":
            raise StageSkipped("without a GPU reader the card's free memory is unknown or an estimate: an "
                               "out-of-memory is not staged on a guess")
        return int(free)

    async def _oom_retry(self, tenant: str, mark: int, prompt_id: str, wait_s: float = 30.0) -> dict[str, Any]:
        """The proxy's decision about this OOM: it reads ComfyUI's history first, then plans and re-queues."""
        deadline = self.clock.now() + wait_s
        while self.clock.now() < deadline:
            for d in await self._decisions_after(mark, tenant):
                mine = d["outcome"].get("prompt_id") == prompt_id or prompt_id in str(d.get("trigger"))
                if mine and d["outcome"].get("oom_retry"):  # set once the retry is decided
                    return d
            await self.clock.sleep(0.1)
        raise StageFailed(f"{tenant} ran out of memory on prompt {prompt_id} and the proxy decided nothing within {wait_s:g} s",
                          impact="a prompt that runs out of memory is not retried although idle tenants hold memory",
                          fix=f"check that {tenant}'s websocket and /history reach the proxy (`hyperswap check`), "
                              "then see the proxy's log")

    async def stage_too_large(self) -> str:
        total = self.found.device.get("total_bytes")
        t = next((t for t in self.found.tenants.values() if t.url and t.name not in self.found.unreachable), None)
        if t is None:
            raise StageSkipped("no tenant reachable through the proxy")
        if total is None:
            raise StageSkipped("the card's size is unknown (no GPU reader and no engine reports it)")
        need = int(total) + GIB
        plan = await self.admin.plan(t.name, need)
        if plan.get("feasible") or plan.get("possible", True):
            raise StageFailed(f"the proxy's plan for {gib(need)} on a {gib(total)} card is {plan.get('outcome')}: "
                              f"{plan.get('explanation')}", impact="a load larger than the card would be forwarded and "
                              "fail with out of memory instead of a clear 507", fix="report it with this output")
        detail = f"dry run: {gib(need)} on the {gib(total)} card is refused ({plan.get('explanation')})"
        if t.engine == GENERATES and t.url:
            usable = int(total) - int(self.found.device.get("reserved_bytes") or 0)
            client = self._ollama(t)
            big = [m for m in await client.models() if m.size + t.context_allowance_bytes > usable]
            if big:
                r = await self.http.post(t.url + "/api/generate", json={"model": big[0].name, "prompt": "hi", "stream": False})
                body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                if r.status_code != 507 or "blockers" not in body:
                    raise StageFailed(f"{big[0].name} ({gib(big[0].size)}) answered {r.status_code}, not 507",
                                      impact="a model larger than the card is not refused with the processes in the way",
                                      fix="report it with this output")
                detail += f"; {big[0].name} ({gib(big[0].size)}) through {t.url}: 507 ({body.get('fix')})"
        return detail

    def _restore_needed(self) -> bool:
        return bool(self.found.loaded_by_us) or self.found.ollama_before is not None or self.found.released_comfy

    async def stage_restore(self) -> str:
        notes: list[str] = []
        ollama = next((t for t in self.found.tenants.values() if t.engine == GENERATES and t.url
                       and t.name not in self.found.unreachable), None)
        if ollama is not None:
            client = self._ollama(ollama)
            now = await client.loaded()
            mine = [m for m in self.found.loaded_by_us if m in now]
            for name in mine:
                await client.unload(name)
            back = [m for m in (self.found.ollama_before or {}) if m not in now]
            failed = []
            for name in back:
                try:
                    await client.load(name)
                except Unexpected as exc:
                    failed.append(f"{name}: {exc}")
            if failed:
                raise StageFailed(f"could not load again what verify unloaded: {'; '.join(failed)}",
                                  impact="the first request to these models waits for their load",
                                  fix=f"load them again yourself (`ollama run {back[0]}`)")
            if mine:
                notes.append(f"unloaded what verify loaded ({', '.join(sorted(mine))})")
            if back:
                notes.append(f"loaded again {', '.join(back)}")
        if self.found.released_comfy:
            notes.append("ComfyUI loads its checkpoint again on its next prompt")
        if not notes:
            raise StageSkipped("nothing to restore: verify left every model as it found it")
        return "; ".join(notes)
