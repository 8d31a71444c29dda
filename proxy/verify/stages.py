"""The stages of `hyperswap verify`, one function each over the runner's state (`Verify`): each
returns what it proved, or raises StageFailed (what broke, what that breaks, the fix) or
StageSkipped (why it could not run here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from proxy.config.units import GIB
from proxy.encoding import JSONObject, as_object
from proxy.handoff.decision_json import Decision
from proxy.handoff.plan_json import Plan
from proxy.handoff.release_result import ReleaseOutcome
from proxy.verify.clients import (
    GraphRun,
    OllamaClient,
    OllamaModel,
    TenantInfo,
    Unexpected,
    gb_bytes,
    gib,
    number,
    the_graph,
)
from proxy.verify.report import StageFailed, StageSkipped
from proxy.verify.roles import GENERATES, RENDERS, adapter_class, role_of

if TYPE_CHECKING:
    from proxy.verify.session import Session

class NoCandidate(Exception):
    """This direction of the reclaim cannot be staged with what is installed; the reason says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def check_proxy(v: Session) -> str:
    """The admin API answers: the tenants and the card as the proxy sees them."""
    try:
        tenants = await v.admin.tenants()
        stats = await v.admin.stats()
    except (httpx.HTTPError, Unexpected, ValueError, KeyError) as exc:
        raise StageFailed(f"no HyperSwap admin API answers at {v.admin.base}: {type(exc).__name__}: {exc}",
                          impact="nothing can be verified: clients reach no proxy, so nothing arbitrates the GPU",
                          fix="start it with `hyperswap serve` (or `hyperswap demo`), or pass --admin URL") from None
    v.found.tenants = {t.name: t for t in tenants}
    v.found.device = dev = as_object(stats.get("device"))
    v.report.gpu_reader = (stats.get("gpu_error") is None and dev.get("source") not in (None, "engine-estimate")
                           and dev.get("total_bytes") is not None)
    gpu_error = stats.get("gpu_error")
    gpu_note = "" if gpu_error is None else f"; GPU reader: {as_object(gpu_error).get('error')}"
    return (f"admin API at {v.admin.base}: {len(tenants)} tenant(s) ({', '.join(v.found.tenants)}), "
            f"{gpu_text(dev)}{gpu_note}")


def gpu_text(dev: JSONObject) -> str:
    """The card as the proxy sees it, saying what is not known rather than "GPU unknown ... unknown"."""
    name, total, source = dev.get("name"), dev.get("total_bytes"), dev.get("source")
    if name is None and total is None:
        return "GPU not known: no GPU reader reads it and no engine reports it"
    size = gib(total) if total is not None else "size not known"
    return f"GPU {name or '(name not known)'} {size}" + (f" ({source})" if source else "")


def on_cpu(body: object) -> bool:
    """A probe's answer lists devices, all of them CPUs (ComfyUI's /system_stats after --cpu)."""
    devices = as_object(body).get("devices")
    if not isinstance(devices, list) or not devices:
        return False
    return all(isinstance(d, dict) and d.get("type") == "cpu" for d in devices)


async def check_upstream(v: Session, t: TenantInfo) -> str:
    """The engine answers through its drop-in port (a 502 from the proxy: the engine is down)."""
    assert t.url
    probe = adapter_class(t.engine)
    path = probe.probe_path
    ready = as_object(t.config.get("ready"))
    judged_by_ready = not probe.probe_strict and bool(ready.get("path"))
    if judged_by_ready:  # an app of its own: the path tenants.json says answers once it serves
        path = str(ready["path"])
    impact = f"clients of {t.name} at {t.url} get errors, and the proxy cannot ask {t.name} for memory back"
    try:
        r = await v.http.get(t.url + path)
    except httpx.HTTPError as exc:
        v.found.unreachable[t.name] = "listener"
        raise StageFailed(f"the proxy's listener for {t.name} does not answer at {t.url}: {type(exc).__name__}",
                          impact=impact, fix=f"check tenants.{t.name}.listen and restart `hyperswap serve`") from None
    if judged_by_ready:
        ok = r.status_code == (number(ready.get("status")) or 200)
    else:
        ok = r.status_code == 200 if probe.probe_strict else r.status_code < 500
    if not ok:
        v.found.unreachable[t.name] = "upstream"
        answer = Unexpected(f"GET {path} through {t.url}", r)
        raise StageFailed(f"{t.name} ({t.upstream}) is not answering through the proxy: {answer}", impact=impact,
                          fix=answer.fix() or f"start {t.name}, or correct tenants.{t.name}.upstream ({t.upstream})")
    if judged_by_ready:
        return (f"{t.url}{path} -> {t.upstream}: {r.status_code}, ready as tenants.{t.name}.ready says; "
                f"not exercised: any request of {t.name}'s own (verify knows none)")
    if not probe.probe_strict:
        # A generic app: any answer shows its port accepts connections, nothing about the app itself.
        return (f"{t.url}{path} -> {t.upstream}: {t.name}'s upstream accepted a connection (GET {path} answered "
                f"{r.status_code}); not exercised: any request of {t.name}'s own (verify knows none; "
                f"tenants.{t.name}.ready.path names one it can judge)")
    cpu = ""
    try:  # a probe that lists the engine's devices (ComfyUI's /system_stats): only CPUs there is worth saying
        if on_cpu(r.json()):
            cpu = (f"; {t.name} runs on the CPU (its {path} lists no GPU device): it holds no GPU memory, so a "
                   "release of it frees nothing on the card")
    except ValueError:
        pass
    return f"{t.url}{path} -> {t.upstream}: {r.status_code}{cpu}"


async def check_generation(v: Session) -> str:
    """A few tokens from the smallest installed model that can generate (a chat model: an embedding
    model may be smaller), through the proxy."""
    t = v.tenant_of(GENERATES)
    client = v.ollama(t)
    model = (await v.generation_models(client))[0]
    plan = await v.plan_allows(t, model.size + t.context_allowance_bytes, model.name)
    await v.nobody_busy()
    started = v.clock.now()
    body = await v.generate(t, client, model)
    released = ", ".join(r.tenant for r in plan.releases)
    return (f"{model.name} ({gib(model.size)}, the smallest chat model) answered {body.get('eval_count', '?')} token(s) "
            f"through {t.url} in {v.clock.now() - started:.2f} s" + (f", after releasing {released}" if released else ""))


async def check_graph(v: Session) -> str:
    """The user's graph, or a minimal one, through the proxy to its end marker; what it leaves held."""
    t = v.tenant_of(RENDERS)
    await v.plan_allows(t, None, f"a {t.name} graph")
    await v.nobody_busy()
    run, ckpt, whose = await v.run_graph(t)
    if not run.ok:
        raise StageFailed(f"{whose} graph ({ckpt or 'no checkpoint'}) ended with {run.error_type}: {run.error}",
                          impact=f"{t.name} prompts through the proxy fail",
                          fix=(f"raise tenants.{t.name}.needs_vram_gb: the proxy made less room than the graph takes"
                               if run.error_type and "OutOfMemory" in run.error_type
                               else f"run the graph in {t.name}'s own UI and read its log"))
    held = (await v.admin.tenant(t.name)).vram_bytes
    v.found.graph_held = held
    return (f"{whose} graph ({ckpt or 'no checkpoint'}) ran through {t.url}, followed by {run.followed}; "
            f"{t.name} holds {gib(held)} after it")


async def check_reclaim(v: Session) -> str:
    """One tenant needs memory another holds idle: ComfyUI holds a checkpoint and an Ollama model
    needs it, else (no model that large) Ollama holds a model and the ComfyUI graph needs it. Which
    way, and whether either can be staged, is decided from dry-run plans before anything is changed."""
    v.need_consent("reclaim")
    comfy_t, ollama_t = v.tenant_of(RENDERS), v.tenant_of(GENERATES)
    await v.nobody_busy()
    if v.found.graph is None:
        raise StageSkipped(f"the {comfy_t.name} graph did not run, so the handoff cannot be staged")
    if v.report.gpu_reader is not True:
        raise StageSkipped("without a GPU reader the card cannot confirm the release a handoff makes, so none was "
                           "staged: fix the GPU reader (`hyperswap check`) to verify it")
    comfy_now = await v.admin.tenant(comfy_t.name)
    try:
        model, plan = await _generation_needing(v, comfy_t, ollama_t, comfy_now)
    except NoCandidate as first:
        try:
            model = await _model_crowding_graph(v, comfy_t, ollama_t, comfy_now)
        except NoCandidate as second:
            raise StageSkipped(f"{first.reason}; and {second.reason}") from None
        _no_timer_within_stage(v, ollama_t)
        return await _reclaim_for_graph(v, comfy_t, ollama_t, model)
    _no_timer_within_stage(v, comfy_t)
    return await _reclaim_for_generation(v, comfy_t, ollama_t, model, plan)


async def _generation_needing(v: Session, holder_t: TenantInfo, needer_t: TenantInfo,
                              holder_now: TenantInfo) -> tuple[OllamaModel, Plan]:
    """The smallest model whose plan releases the holder once it holds what the graph left (no effect)."""
    # The graph run right before the handoff loads again what the holder's idle timer may have freed since.
    missing = max(0, (v.found.graph_held or 0) - (holder_now.vram_bytes or 0))
    for model in await v.generation_models(v.ollama(needer_t)):
        plan = await v.admin.plan(needer_t.name, model.size + needer_t.context_allowance_bytes + missing)
        if plan.feasible and holder_t.name in [r.tenant for r in plan.releases]:
            return model, plan
    raise NoCandidate(f"no installed {needer_t.name} model needs the {gib(v.found.graph_held)} {holder_t.name} "
                      "holds after its graph (each fits beside it, or not on this card at all)")


async def _model_crowding_graph(v: Session, needer_t: TenantInfo, holder_t: TenantInfo, needer_now: TenantInfo) -> OllamaModel:
    """The largest model that loads without a release once the graph's tenant is down to its floor,
    if a graph then cannot fit beside it (no effect: the dry-run plans and the card's figures)."""
    floor = gb_bytes(needer_t.config.get("idle_vram_gb"))
    held = needer_now.vram_bytes or 0
    freed = max(0, held - floor)  # what releasing the graph's tenant gives back
    free = await v.free_memory(holder_t)
    model = None
    for m in sorted(await v.generation_models(v.ollama(holder_t)), key=lambda m: -m.size):
        need = m.size + holder_t.context_allowance_bytes
        plan = await v.admin.plan(holder_t.name, max(need - freed, 1 << 20))
        if plan.feasible and not plan.releases:
            model = m
            break
    if model is None:
        raise NoCandidate(f"no installed {holder_t.name} model loads beside {needer_t.name}'s floor without a release")
    graph_need = (await v.admin.plan(needer_t.name)).need_bytes
    # Even if Ollama keeps everything it holds now beside the model, a graph needing more than what is
    # free plus what the graph's tenant holds now has to take some of Ollama's memory.
    if graph_need + model.size <= free + held:
        raise NoCandidate(f"with {model.name} (the largest that fits beside {needer_t.name}'s floor) on the card a "
                          f"{needer_t.name} graph ({gib(graph_need)}) still fits beside it")
    return model


def _no_timer_within_stage(v: Session, holder_t: TenantInfo) -> None:
    """The holder's idle timer starts again with the load right before the handoff: if it fires within
    the stage, the release seen could be the timer's, not the handoff's."""
    after = holder_t.config.get("idle_release_after_s")
    if isinstance(after, int | float) and after < v.options.stage_timeout_s:
        raise StageSkipped(f"{holder_t.name}'s idle timer frees it in {float(after):g} s after its last request, within "
                           "this stage's time: its release could not be told from the timer's (raise "
                           f"tenants.{holder_t.name}.idle_release_after_s above {v.options.stage_timeout_s:g} s)")


async def _reclaim_for_generation(v: Session, holder_t: TenantInfo, needer_t: TenantInfo, model: OllamaModel,
                                  plan: Plan) -> str:
    # A fresh graph right before: the holder's idle timer starts again and cannot free it mid-stage.
    run, _, _ = await v.run_graph(holder_t)
    if not run.ok:
        raise StageFailed(f"the graph before the reclaim failed: {run.error_type}: {run.error}",
                          impact=f"{holder_t.name} prompts through the proxy fail", fix=f"see {holder_t.name}'s log")
    holder = await _holder(v, holder_t.name)
    client = v.ollama(needer_t)
    v.say(f"reclaim: loading {model.name} makes the proxy release {holder.name} ({gib(holder.vram_bytes)})")
    mark = await v.last_decision_id()
    started = v.clock.now()
    await v.generate(needer_t, client, model)
    took = v.clock.now() - started
    v.found.released.add(holder.name)
    after, release = await _confirm_release(v, needer_t.name, holder, mark, model.name)
    on_gpu = (await client.loaded()).get(model.name, 0)
    if on_gpu <= 0:
        raise StageFailed(f"{model.name} is not on the GPU after {holder.name}'s release",
                          impact=f"{model.name} runs from the CPU or not at all",
                          fix=f"see GET /api/decisions and {needer_t.name}'s log")
    return (f"{model.name} needed {gib(plan.need_bytes)}: the proxy released {holder.name} "
            f"({gib(holder.vram_bytes)} -> {gib(after)} on the card, {release.duration_s} s) and "
            f"{model.name} loaded ({gib(on_gpu)} on the GPU) in {took:.2f} s")


async def _reclaim_for_graph(v: Session, needer_t: TenantInfo, holder_t: TenantInfo, model: OllamaModel) -> str:
    # ComfyUI down to its floor, so its graph has to load again and needs the card.
    await v.release(needer_t, "the handoff")
    client = v.ollama(holder_t)
    plan = await v.admin.plan(holder_t.name, model.size + holder_t.context_allowance_bytes)
    if not plan.feasible or plan.releases:
        raise StageSkipped(f"{model.name} no longer loads beside {needer_t.name}'s floor ({plan.explanation})")
    # Loaded right before, so Ollama's own keep-alive timer is fresh and cannot free it mid-stage.
    await v.generate(holder_t, client, model)
    graph_plan = await v.admin.plan(needer_t.name)
    if holder_t.name not in [r.tenant for r in graph_plan.releases]:
        raise StageSkipped(f"with {model.name} on the card a {needer_t.name} graph still fits "
                           f"({graph_plan.explanation})")
    holder = await _holder(v, holder_t.name)
    v.say(f"reclaim: the {needer_t.name} graph makes the proxy release {holder.name} ({gib(holder.vram_bytes)})")
    mark = await v.last_decision_id()
    started = v.clock.now()
    run, ckpt, _ = await v.run_graph(needer_t)
    took = v.clock.now() - started
    if not run.ok:
        raise StageFailed(f"the graph after {holder.name}'s release failed: {run.error_type}: {run.error}",
                          impact=f"{needer_t.name} prompts fail although the proxy made room",
                          fix=f"raise tenants.{needer_t.name}.needs_vram_gb to what its graphs take")
    after, release = await _confirm_release(v, needer_t.name, holder, mark, the_graph(ckpt))
    now = (await v.admin.tenant(needer_t.name)).vram_bytes
    return (f"a {needer_t.name} graph needed {gib(graph_plan.need_bytes)} while {model.name} held the card: the "
            f"proxy released {holder.name} ({gib(holder.vram_bytes)} -> {gib(after)} on the card, "
            f"{release.duration_s} s) and {the_graph(ckpt)} ran ({needer_t.name} holds {gib(now)}) in {took:.2f} s")


async def _holder(v: Session, name: str) -> TenantInfo:
    holder = await v.admin.tenant(name)
    if holder.vram_bytes is None:
        raise StageSkipped(f"what {name} holds cannot be seen (no GPU reader): a release cannot be confirmed")
    if holder.idle_release_in_s is not None and holder.idle_release_in_s < v.options.stage_timeout_s:
        raise StageSkipped(f"{name}'s idle timer frees it in {holder.idle_release_in_s:g} s, within this "
                           "stage's time: its release could not be told from the timer's (raise "
                           f"tenants.{name}.idle_release_after_s above {v.options.stage_timeout_s:g} s)")
    return holder


async def _confirm_release(v: Session, requester: str, holder: TenantInfo, mark: int,
                           what: str) -> tuple[int, ReleaseOutcome]:
    """The proxy's plan for the load released the holder, and the card shows its memory back."""
    assert holder.vram_bytes is not None
    after = (await v.admin.tenant(holder.name)).vram_bytes or 0
    releases = [r for d in await v.decisions_after(mark, requester) if d.kind == "plan"
                for r in d.outcome.releases or [] if r.tenant == holder.name]
    impact = (f"loads that need {holder.name}'s idle memory wait for the release timeout, then spill to the CPU "
              "or run out of memory")
    if not releases:
        raise StageFailed(f"{what} loaded but the proxy's decisions show no release of {holder.name}",
                          impact=impact, fix="see GET /api/decisions; report it with this output")
    reclaimable = holder.vram_bytes - gb_bytes(holder.config.get("idle_vram_gb"))
    freed = holder.vram_bytes - after
    last = releases[-1]
    if last.estimated and not last.error:
        # No GPU reader: the engines' own reports say the handoff happened; the card cannot say so.
        raise StageSkipped(f"{what} loaded after the proxy released {holder.name} ({gib(holder.vram_bytes)} -> "
                           f"{gib(after)} by its own report), but without a GPU reader the card cannot confirm the "
                           "release: fix the GPU reader (`hyperswap check`) to verify it")
    if not last.confirmed or freed < reclaimable / 2:
        raise StageFailed(
            f"{holder.name}'s release never showed on the card: it held {gib(holder.vram_bytes)}, holds {gib(after)} "
            f"now ({last.error or 'not confirmed'})", impact=impact,
            fix=(f"see GET /api/tenants/{holder.name} and {holder.name}'s log: an engine that answers its release "
                 f"but keeps the memory needs a stronger release (release.free_memory), or give it longer "
                 f"(tenants.{holder.name}.release_timeout_s)"))
    return after, last


async def check_out_of_memory(v: Session) -> str:
    """Staged only where safe: free memory between what the proxy plans for a graph and what its
    checkpoint really takes, so only ComfyUI's own allocation fails; the proxy must retry it."""
    v.need_consent("out of memory")
    comfy_t, ollama_t = v.tenant_of(RENDERS), v.tenant_of(GENERATES)
    ckpt, held = v.found.graph_ckpt, v.found.graph_held
    await v.nobody_busy()
    if v.found.graph is None or held is None:
        raise StageSkipped(f"the {comfy_t.name} graph did not run, so its footprint is unknown")
    declared = _declared_for_graph(comfy_t, ckpt)
    # Before touching anything: the proxy makes `declared` less what ComfyUI holds free for a graph,
    # and the graph loads `held` less the same floor, so a window exists only if held > declared.
    if held <= declared:
        raise StageSkipped(f"the proxy plans {gib(declared)} for a {comfy_t.name} graph, at least the {gib(held)} the "
                           f"{the_graph(ckpt)[4:]} took: it cannot run out of memory through the proxy, so no out-of-memory "
                           "can be provoked safely (the retry is covered by the tests on a simulated box)")
    client, models = await _models_that_could_fill(v, comfy_t, ollama_t, held, declared)
    await _empty_both(v, comfy_t, ollama_t, client)
    floor = (await v.admin.tenant(comfy_t.name)).vram_bytes or 0
    free = await v.free_memory(ollama_t)
    # Free memory between what the proxy plans for and what the graph really loads: the proxy sees
    # room, the engine runs out, and only ComfyUI's own allocation fails (it unloads and reports).
    lo, hi = declared - floor, held - floor
    model = _filler(ollama_t.name, models, lo, hi, free)
    v.say(f"out of memory: {model.name} fills the card so {the_graph(ckpt)} cannot load beside it")
    await v.generate(ollama_t, client, model)
    free = await v.free_memory(ollama_t)
    if not lo <= free < hi:
        raise StageSkipped(f"with {model.name} loaded {gib(free)} is free, outside {gib(lo)}..{gib(hi)}: not staged")
    mark = await v.last_decision_id()
    graph = v.found.graph
    v.did(f"ran {the_graph(ckpt)} in {comfy_t.name} with {model.name} filling the card")
    run = await v.comfy(comfy_t).run(graph)
    return await _judge_oom_retry(v, comfy_t, run, mark, f"with {model.name} on the card ({gib(free)} free), "
                                  f"{the_graph(ckpt)}", free)


def _declared_for_graph(comfy_t: TenantInfo, ckpt: str | None) -> int:
    """What the proxy plans for the graph: its checkpoint's declared size, else the tenant's need."""
    declared_gb = as_object(comfy_t.config.get("model_vram_gb")).get(ckpt or "")
    return gb_bytes(declared_gb) if declared_gb is not None else comfy_t.needs_vram_bytes


async def _models_that_could_fill(v: Session, comfy_t: TenantInfo, ollama_t: TenantInfo, held: int,
                                  declared: int) -> tuple[OllamaClient, list[OllamaModel]]:
    """Ollama's client and its generation models, once some model could leave free memory in the window
    with both tenants emptied (a guess from what they hold now): skips, before unloading anything, if none."""
    stats = await v.admin.stats()
    await v.free_memory(ollama_t, stats)  # skips now, before unloading anything, without a GPU reader
    client = v.ollama(ollama_t)
    models = await v.generation_models(client)
    floor_guess = min(held, gb_bytes(comfy_t.config.get("idle_vram_gb")))
    ollama_now = (await v.admin.tenant(ollama_t.name)).vram_bytes or 0
    comfy_now = (await v.admin.tenant(comfy_t.name)).vram_bytes or 0
    free_guess = (number(as_object(stats.get("device")).get("free_bytes")) or 0) + ollama_now + max(0, comfy_now - floor_guess)
    lo, hi = declared - floor_guess, held - floor_guess
    if not [m for m in models if lo <= free_guess - m.size < hi]:
        raise StageSkipped(_no_filler(ollama_t.name, models, lo, hi, free_guess, "about {free} free with both emptied"))
    return client, models


async def _empty_both(v: Session, comfy_t: TenantInfo, ollama_t: TenantInfo, client: OllamaClient) -> None:
    """Ollama unloaded and empty on the card, ComfyUI released: the window is measured from there."""
    for name in await client.loaded():  # the window is measured with Ollama empty
        v.did(f"unloaded {name} from {ollama_t.name}")
        await client.unload(name)
    await v.wait_empty(ollama_t.name)
    await v.release(comfy_t, "the out-of-memory")  # its checkpoint off the card: the graph loads it again


def _filler(tenant: str, models: list[OllamaModel], lo: int, hi: int, free: int) -> OllamaModel:
    """The model that leaves free memory nearest the middle of [lo, hi); skips if none leaves it inside."""
    fits = [m for m in models if lo <= free - m.size < hi]
    if not fits:
        raise StageSkipped(_no_filler(tenant, models, lo, hi, free, "{free} free now"))
    return min(fits, key=lambda m: abs(free - m.size - (lo + hi) / 2))


async def _judge_oom_retry(v: Session, comfy_t: TenantInfo, run: GraphRun, mark: int, staged: str,
                           free: int) -> str:
    """The staged graph ran out of memory: the proxy must have released and run it again under the
    prompt id the client holds, which the client saw end in success, the out-of-memory never."""
    if run.ok:
        retry = await _oom_retry(v, comfy_t.name, mark, run.prompt_id, wait_s=0.0)
        if retry is None:
            raise StageSkipped(f"{comfy_t.name} ran the graph in {gib(free)} without running out of memory (it may "
                               "load part of a model at a time): the out-of-memory path was not reached")
        released = ", ".join(f"{r.tenant} ({r.freed_gb} GiB)" for r in retry.outcome.releases or [])
        return (f"{staged} ran out of memory in {comfy_t.name}; the proxy released {released or 'nobody'} and ran it "
                f"again under the client's own id {run.prompt_id}, which succeeded (the client never saw the out-of-memory)")
    if not run.error_type or "OutOfMemory" not in run.error_type:
        raise StageFailed(f"the graph failed with {run.error_type}: {run.error}", impact=f"{comfy_t.name} prompts fail",
                          fix=f"see {comfy_t.name}'s log")
    retry = await _oom_retry(v, comfy_t.name, mark, run.prompt_id)
    if retry is None:
        raise StageFailed(f"{comfy_t.name} ran out of memory on prompt {run.prompt_id} and the proxy decided nothing",
                          impact="a prompt that runs out of memory is not retried although idle tenants hold memory",
                          fix=f"check that {comfy_t.name}'s websocket and /history reach the proxy (`hyperswap check`), "
                              "then see the proxy's log")
    outcome = retry.outcome
    if outcome.oom_retry in ("requeued", "succeeded"):
        raise StageFailed(f"{comfy_t.name} ran out of memory; the proxy retried it ({outcome.oom_retry}) but the "
                          f"client saw the out-of-memory of prompt {run.prompt_id}",
                          impact="a person sees a failed image although the proxy's retry ran",
                          fix=f"see GET /api/decisions (decision {retry.id}) and the proxy's log")
    if outcome.oom_retry == "failed":
        raise StageFailed(f"the retried prompt {run.prompt_id} ran out of memory again",
                          impact="a prompt that runs out of memory fails even after the proxy made room",
                          fix=f"raise tenants.{comfy_t.name}.needs_vram_gb to what its graphs take")
    raise StageFailed(f"{comfy_t.name} ran out of memory and the proxy did not retry: {outcome.oom_retry}",
                      impact="a prompt that runs out of memory fails although idle tenants hold memory",
                      fix=f"see GET /api/decisions (decision {retry.id}) and the proxy's log")


async def _oom_retry(v: Session, tenant: str, mark: int, prompt_id: str, wait_s: float = 30.0) -> Decision | None:
    """The proxy's decision about this prompt's OOM (it reads ComfyUI's history first, then plans
    and re-queues), once its retry is decided; None when none came within `wait_s`."""
    deadline = v.clock.now() + wait_s
    while True:
        for d in await v.decisions_after(mark, tenant):
            mine = d.outcome.prompt_id == prompt_id or prompt_id in d.trigger
            if mine and d.outcome.oom_retry:  # set once the retry is decided
                return d
        if v.clock.now() >= deadline:
            return None
        await v.clock.sleep(v.options.poll_s)


def _no_filler(tenant: str, models: list[OllamaModel], lo: int, hi: int, free: int, how: str) -> str:
    """Why no out-of-memory can be staged: no installed model leaves free memory in [lo, hi); which
    sizes would, and the installed ones, so the reader sees how far off they are."""
    sizes = ", ".join(f"{m.name} {gib(m.size)}" for m in sorted(models, key=lambda m: m.size))
    window = (f"a model of more than {gib(free - hi)} and at most {gib(free - lo)} would" if free - lo > 0
              else "none could: the card is too small for the window")
    return (f"no installed {tenant} model leaves free memory between {gib(lo)} and {gib(hi)} "
            f"({how.format(free=gib(free))}; {window}; installed: {sizes}): an out-of-memory cannot be staged safely")


async def check_too_large(v: Session) -> str:
    """More than the card is refused: a dry-run plan, and a real 507 for an installed model that large."""
    total = number(v.found.device.get("total_bytes"))
    t = next((t for t in v.found.tenants.values() if t.url and t.name not in v.found.unreachable), None)
    if t is None:
        raise StageSkipped("no tenant reachable through the proxy")
    if total is None:
        raise StageSkipped("the card's size is unknown (no GPU reader and no engine reports it)")
    need = total + GIB
    plan = await v.admin.plan(t.name, need)
    if plan.feasible or plan.possible:
        raise StageFailed(f"the proxy's plan for {gib(need)} on a {gib(total)} card is {plan.outcome}: "
                          f"{plan.explanation}", impact="a load larger than the card would be forwarded and "
                          "fail with out of memory instead of a clear 507", fix="report it with this output")
    detail = f"dry run: {gib(need)} on the {gib(total)} card is refused ({plan.explanation})"
    if role_of(t) == GENERATES and t.url:
        usable = total - (number(v.found.device.get("reserved_bytes")) or 0)
        client = v.ollama(t)
        big = [m for m in await client.models() if m.size + t.context_allowance_bytes > usable]
        if big:
            r = await v.http.post(t.url + "/api/generate", json={"model": big[0].name, "prompt": "hi", "stream": False})
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code != 507 or "blockers" not in body:
                raise StageFailed(f"{big[0].name} ({gib(big[0].size)}) answered {r.status_code}, not 507",
                                  impact="a model larger than the card is not refused with the processes in the way",
                                  fix="report it with this output")
            detail += f"; {big[0].name} ({gib(big[0].size)}) through {t.url}: 507 ({body.get('fix')})"
    return detail


async def _released_and_not_restored(v: Session) -> list[str]:
    """The tenants verify released that hold less now than when it started (it does not load them again)."""
    out = []
    for name in sorted(v.found.released):
        before = v.found.tenants[name].vram_bytes if name in v.found.tenants else None
        now_held = (await v.admin.tenant(name)).vram_bytes
        if before is not None and now_held is not None and now_held < before - GIB // 4:
            out.append(f"{name} held {gib(before)} when verify started and holds {gib(now_held)} now (verify "
                       "does not load it again: its next prompt loads what it needs)")
    return out


async def _load_again(v: Session, ollama: TenantInfo, client: OllamaClient, back: list[str]) -> list[str]:
    """Load again what verify unloaded: each model with how it was loaded. Raises StageFailed naming
    those that did not load."""
    failed, calls = [], []
    for name in back:
        v.did(f"loaded {name} in {ollama.name} again")
        try:
            calls.append(f"{name} ({await client.load(name)})")
        except Unexpected as exc:
            failed.append(f"{name}: {exc}")
    if failed:
        raise StageFailed(f"could not load again what verify unloaded: {'; '.join(failed)}",
                          impact="the first request to these models waits for their load",
                          fix=f"load them again yourself (`ollama run {back[0]}`)")
    return calls


async def restore(v: Session) -> str:
    """What Ollama held when verify started (its /api/ps then) is what it holds at the end: models
    verify unloaded are loaded again (an embedding model with an embed call), models it loaded
    itself are unloaded, nothing more. A tenant verify released is not loaded again: it says so."""
    not_restored = await _released_and_not_restored(v)
    ollama = v.generator()
    client = v.ollama(ollama) if ollama is not None else None
    mine, back = await _changed_since_start(v, client)
    left = f"not restored: {'; '.join(not_restored)}" if not_restored else ""
    if client is None or not (mine or back):
        return _nothing_to_restore(checked=client is not None, left=left)
    await v.nobody_busy()
    assert ollama is not None
    for name in mine:
        v.did(f"unloaded {name} from {ollama.name}")
        await client.unload(name)
    calls = await _load_again(v, ollama, client, back)
    return _restored(ollama.name, mine, calls, left)


async def _changed_since_start(v: Session, client: OllamaClient | None) -> tuple[list[str], list[str]]:
    """What Ollama holds that verify loaded itself, and what it held at the start that it no longer
    does (both empty without an Ollama tenant)."""
    now = await client.loaded() if client is not None else {}
    mine = sorted(m for m in v.found.loaded_by_us if m in now)
    back = [m for m in (v.found.ollama_before or {}) if m not in now]
    return mine, back


def _nothing_to_restore(checked: bool, left: str) -> str:
    """Nothing for Ollama to unload or load again: checked and as it was, the stage's promise holds;
    otherwise it skips, naming what was not restored."""
    if checked and not left:
        return "nothing to restore: Ollama holds what it held when verify started"
    raise StageSkipped("nothing to restore: Ollama holds what it held when verify started" + (f"; {left}" if left else ""))


def _restored(ollama: str, mine: list[str], calls: list[str], left: str) -> str:
    """The stage's line: what was unloaded, what was loaded again (with how), what was not restored."""
    notes: list[str] = []
    if mine:
        notes.append(f"unloaded what verify loaded ({', '.join(mine)})")
    if calls:
        notes.append(f"loaded again what {ollama} held before verify: {', '.join(calls)}")
    if left:
        notes.append(left)
    return "; ".join(notes)
