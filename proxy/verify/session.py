"""`hyperswap verify`'s session: the state and shared steps of one run, handed to every stage."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

from proxy.clock import Clock, SystemClock
from proxy.encoding import JSONObject, as_object
from proxy.handoff.decision_json import Decision
from proxy.handoff.plan_json import Plan
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
    gb_bytes,
    gib,
    graph_checkpoint,
    minimal_graph,
    number,
)
from proxy.verify.report import Report, StageFailed, StageResult, StageSkipped
from proxy.verify.roles import GENERATES, RENDERS, fails, kinds_for, role_of


@dataclass(slots=True)
class Options:
    admin: str
    yes: bool = False
    interactive: bool = False  # may ask on the terminal; else no --yes means no consent
    comfy_graph: JSONObject | None = None
    comfy_checkpoint: str | None = None
    stage_timeout_s: float = 180.0
    # How long a stage that loads anything waits for busy tenants to finish before it is skipped
    # (once one wait ran out, later stages look once and do not wait again).
    busy_wait_s: float = 60.0
    # How often a wait looks again (memory back on the card, a graph's history, the proxy's OOM
    # decision). Each look is one admin or engine request; the tests look more often.
    poll_s: float = 0.1


Ask = Callable[[str], bool]


@dataclass(slots=True)
class Found:
    """What earlier stages learnt that later ones build on."""
    tenants: dict[str, TenantInfo] = field(default_factory=dict)
    device: JSONObject = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    ollama_before: dict[str, int] | None = None  # Ollama's /api/ps when verify started
    loaded_by_us: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)  # render tenants verify had released (not loaded again)
    graph: JSONObject | None = None
    graph_ckpt: str | None = None
    graph_held: int | None = None  # what the render tenant held right after the graph
    busy_wait_ran_out: bool = False  # a stage waited busy_wait_s for busy tenants in vain


class Session:
    """What the stages are handed: the options, the clients, what earlier stages found, and the steps
    several stages share. The runner (`Verify`) adds the stage order and runs them."""

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
        self.found = Found()
        self.consent = False
        self.report = Report(options.admin)
        # What the running stage changed on the box, in order: a stage that changed something is
        # never reported as skipped, and its result says what it did (the runner resets this).
        self.effects: list[str] = []

    def did(self, what: str) -> None:
        """Record an effect of the running stage ("released comfyui"), right before it is asked."""
        self.effects.append(what)

    # -- helpers -----------------------------------------------------------------------------------
    def tenant_of(self, role: str) -> TenantInfo:
        """The first tenant of an engine kind that clients reach through a listener, and that answered."""
        t = next((t for t in self.found.tenants.values() if role_of(t) == role and t.url), None)
        if t is None:
            raise StageSkipped(f"no {kinds_for(role)} tenant with a listener in this proxy's configuration")
        if t.name in self.found.unreachable:
            raise StageSkipped(f"{t.name} is not reachable through the proxy (see upstream {t.name})")
        return t

    def ollama(self, t: TenantInfo) -> OllamaClient:
        assert t.url
        return OllamaClient(t.url, self.http)

    def comfy(self, t: TenantInfo) -> ComfyClient:
        assert t.url
        return ComfyClient(t.url, self.http, self.ws, self.clock, self.options.poll_s)

    def need_consent(self, what: str) -> None:
        if not self.consent:
            raise StageSkipped(f"{what}: it releases tenants, so it needs consent (run with --yes)")

    async def nobody_busy(self) -> None:
        """Before a stage loads anything: wait (up to busy_wait_s) until no tenant is busy, else skip
        the stage. Verify never queues work behind a user's, nor releases a tenant under it."""
        waited = 0.0
        limit = 0.0 if self.found.busy_wait_ran_out else self.options.busy_wait_s
        while True:
            busy = [t for t in await self.admin.tenants() if t.busy]
            if not busy:
                return
            who = ", ".join(f"{t.name} ({t.busy_reason})" for t in busy)
            if waited >= limit:
                if limit:
                    self.found.busy_wait_ran_out = True
                waited_text = f", still busy after {waited:.0f} s" if waited else ""
                raise StageSkipped(f"{who} busy{waited_text}: verify never disturbs running work (nothing was loaded); "
                                   "run it again when the box is idle")
            if not waited:
                self.say(f"waiting up to {limit:g} s for {who} to finish: verify never disturbs running work")
            step = max(self.options.poll_s, 0.05)
            await self.clock.sleep(step)
            waited += step

    async def plan_allows(self, tenant: TenantInfo, need: int | None, what: str) -> Plan:
        """The proxy's own dry-run for this load: refused loads fail here, and a load that would
        release someone runs only with consent."""
        plan = await self.admin.plan(tenant.name, need)
        if plan.outcome != "unplanned" and not plan.possible:
            raise StageFailed(f"{what} cannot be loaded on this card: {plan.explanation}",
                              impact=f"{tenant.name} answers 507 to it through the proxy",
                              fix="use a smaller model, or free the memory the plan's blockers hold")
        names = [r.tenant for r in plan.releases]
        if names and not self.consent:
            raise StageSkipped(f"loading {what} would release {', '.join(names)}: that needs consent (run with --yes)")
        return plan

    async def generation_models(self, client: OllamaClient) -> list[OllamaModel]:
        models = [m for m in await client.models() if await client.can_generate(m.name)]
        if not models:
            raise StageSkipped("no installed Ollama model can generate text (`ollama pull llama3.2:1b` adds a small one)")
        return models

    async def decisions_after(self, after_id: int, tenant: str) -> list[Decision]:
        return [d for d in await self.admin.decisions() if d.id > after_id and d.tenant == tenant]

    async def last_decision_id(self) -> int:
        return max((d.id for d in await self.admin.decisions(1)), default=0)

    def generator(self) -> TenantInfo | None:
        return next((t for t in self.found.tenants.values() if role_of(t) == GENERATES and t.url
                     and t.name not in self.found.unreachable), None)

    async def _remember_loaded(self) -> None:
        """What Ollama holds before verify does anything: restore puts back exactly this."""
        ollama = self.generator()
        if ollama is not None:
            try:
                self.found.ollama_before = await self.ollama(ollama).loaded()
            except (httpx.HTTPError, Unexpected, ValueError):
                self.found.ollama_before = None

    # -- consent -----------------------------------------------------------------------------------
    async def _decide_consent(self) -> None:
        if self.options.yes:
            self.consent = True
            return
        self.say(self._what_verify_does())
        if self.options.interactive and self.ask is not None:
            self.consent = await asyncio.to_thread(self.ask, "Go ahead? [y/N] ")
        self.say("consent given" if self.consent else
                 "no consent: stages that release a tenant are skipped (run with --yes to include them)")

    def _what_verify_does(self) -> str:
        """What consent is asked for: the tenants a release would touch, what is loaded again at the
        end and what is not."""
        held = [t for t in self.found.tenants.values() if t.reclaimable
                and (t.vram_bytes or 0) > gb_bytes(t.config.get("idle_vram_gb"))]
        renders = [t.name for t in self.found.tenants.values() if role_of(t) == RENDERS and t.url]
        models = ", ".join(self.found.ollama_before or {})
        return ("verify loads a small model and a small graph, then makes the proxy release idle tenants to prove the "
                "handoff (" + (", ".join(f"{t.name} holds {gib(t.vram_bytes)}" for t in held) or "nobody holds memory now")
                + ")." + (f" The Ollama models loaded now ({models}) are loaded again at the end." if models else "")
                + (f" {' and '.join(renders)}, once released, is not loaded again by verify: its next prompt loads what "
                   "it needs." if renders else "")
                + " Busy tenants are never touched: verify waits for them, or skips.")

    # -- what several stages do -----------------------------------------------------------------
    async def generate(self, t: TenantInfo, client: OllamaClient, model: OllamaModel) -> JSONObject:
        self.did(f"generated with {model.name} in {t.name}")
        try:
            body = await client.generate(model.name)
        except Unexpected as exc:
            if exc.status == 507:
                raise fails(exc, f"the proxy refused {model.name}", f"{model.name} cannot run on this card through the proxy",
                             "use a smaller model or quantisation") from None
            if "out of memory" in exc.error_text().lower():
                raise fails(exc, f"{model.name} ran out of GPU memory", "generations fail although the proxy made room",
                             f"raise tenants.{t.name}.context_allowance_gb (what a model needs beyond its file size)") from None
            raise fails(exc, f"generation with {model.name} failed", f"{t.name}'s clients get this error too",
                         f"see {t.name}'s own log; `hyperswap check`") from None
        if not (self.found.ollama_before or {}).get(model.name):
            self.found.loaded_by_us.add(model.name)
        return body

    async def graph_for(self, t: TenantInfo) -> tuple[JSONObject, str | None, str]:
        if self.options.comfy_graph is not None:
            return self.options.comfy_graph, graph_checkpoint(self.options.comfy_graph), "your"
        info = await self.comfy(t).object_info()
        try:
            graph, ckpt = minimal_graph(info, self.options.comfy_checkpoint, random.randrange(1 << 31))
        except LookupError as exc:
            raise StageSkipped(f"{exc}: pass a graph of your own with --comfy-graph FILE (ComfyUI: Export (API))") from None
        return graph, ckpt, "a minimal"

    async def run_graph(self, t: TenantInfo) -> tuple[GraphRun, str | None, str]:
        graph, ckpt, whose = await self.graph_for(t)
        self.did(f"ran {whose} graph in {t.name}" + (f" (loading {ckpt})" if ckpt else ""))
        try:
            run = await self.comfy(t).run(graph)
        except Unexpected as exc:
            raise fails(exc, f"{whose} graph was refused", f"{t.name} prompts through the proxy fail",
                         "check the graph in ComfyUI's own UI (missing models or nodes show there)") from None
        if run.ok:  # later stages run this graph again
            self.found.graph, self.found.graph_ckpt = graph, ckpt
        return run, ckpt, whose

    async def release(self, t: TenantInfo, why: str) -> None:
        """The admin API's release of an idle tenant, to stage a handoff; restore does not load it again."""
        self.did(f"released {t.name}")
        try:
            await self.admin.release(t.name)
        except Unexpected as exc:
            raise fails(exc, f"{t.name} could not be released to stage {why}",
                        f"loads that need {t.name}'s idle memory wait for its release, then fail",
                        f"see GET /api/tenants/{t.name}") from None
        self.found.released.add(t.name)

    async def wait_empty(self, tenant: str) -> None:
        """An unload answers before the memory is back; the card says when it is (bounded by the stage)."""
        while (await self.admin.tenant(tenant)).vram_bytes:
            await self.clock.sleep(self.options.poll_s)

    async def free_memory(self, tenant: TenantInfo, stats: Mapping[str, object] | None = None) -> int:
        device = as_object((stats if stats is not None else await self.admin.stats()).get("device"))
        free = number(device.get("free_bytes"))
        if free is None or device.get("source") == "engine-estimate":
            raise StageSkipped("without a GPU reader the card's free memory is unknown or an estimate: an "
                               "out-of-memory is not staged on a guess")
        return free

    def _restore_needed(self) -> bool:
        return bool(self.found.loaded_by_us) or self.found.ollama_before is not None or bool(self.found.released)
