// HyperSwap dashboard: plain JS, no build step. Everything comes from the admin API on this origin.
"use strict";
(() => {
  const GIB = 1024 ** 3;
  const STALE_AFTER_MS = 3000;
  const HEALTH_POLL_MS = 3000;
  const ENGINES_POLL_MS = 30000;
  const MODELS_POLL_MS = 4000;
  const HISTORY_MS = 5 * 60 * 1000;
  const MAX_DECISIONS = 200;
  const MAX_STORIES = 5;
  const STORY_DEBOUNCE_MS = 150;
  const PALETTE = ["#3b6fd8", "#8b5cf6", "#0e9f8e", "#d9822b", "#d6457a", "#5f8f1c", "#7c6a55"];
  const DESKTOP_COLOR = "#7b8594";
  const TOKEN_KEY = "hyperswap.token";

  const ui = {
    stats: null, catalog: {}, engines: {}, health: null, healthCollapsed: false, models: null, loads: null,
    decisions: new Map(), history: [], colors: new Map(), lastFrameAt: 0, results: new Map(), stories: new Map(),
  };
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }
  window.hyperswapDom = { el };  // gpu.js (loaded after this file) builds its panel with the same helper
  const gib = (bytes) => (bytes === null || bytes === undefined ? "–" : `${(bytes / GIB).toFixed(bytes >= 10 * GIB ? 1 : 2)} GiB`);
  const known = (bytes) => (bytes === null || bytes === undefined ? "unknown" : gib(bytes));
  const secs = (s) => (s === null || s === undefined ? "–" : s >= 120 ? `${Math.floor(s / 60)} min ${Math.round(s % 60)} s` : `${s.toFixed(s < 10 ? 1 : 0)} s`);
  const clock = (epoch_s) => new Date(epoch_s * 1000).toLocaleTimeString([], { hour12: false });

  function colorOf(tenant) {
    if (!ui.colors.has(tenant.name)) {
      const c = !tenant.reclaimable ? DESKTOP_COLOR : PALETTE[ui.colors.size % PALETTE.length];
      ui.colors.set(tenant.name, c);
    }
    return ui.colors.get(tenant.name);
  }

  // -- the stream ------------------------------------------------------------------------------
  function connect() {
    const es = new EventSource("/api/events");  // reconnects by itself, with Last-Event-ID
    const seen = () => { ui.lastFrameAt = Date.now(); markStale(); };
    es.addEventListener("stats", (ev) => { seen(); onStats(JSON.parse(ev.data)); });
    es.addEventListener("catalog", (ev) => { seen(); ui.catalog = JSON.parse(ev.data).tenants || {}; renderTenants(); });
    es.addEventListener("decision", (ev) => { seen(); onDecision(JSON.parse(ev.data)); });
    es.addEventListener("lifecycle", (ev) => { seen(); onLifecycle(JSON.parse(ev.data)); });
    es.addEventListener("error", () => markStale());
  }
  function markStale() {
    const stale = Date.now() - ui.lastFrameAt > STALE_AFTER_MS;
    $("stale").hidden = !stale;
    document.body.classList.toggle("is-stale", stale);
  }

  function onStats(stats) {
    ui.stats = stats;
    const now = Date.now();
    ui.history.push({ t: now, v: Object.fromEntries(stats.tenants.map((t) => [t.name, t.vram_bytes || 0])), total: stats.device.total_bytes });
    while (ui.history.length && ui.history[0].t < now - HISTORY_MS) ui.history.shift();
    const d = stats.device;
    const waiting = (stats.queue || []).length;
    // what happens now, beside the card: a load on its way, an app starting, the queue
    const happening = [...stats.tenants.filter((t) => t.loading).map((t) => `loading ${t.loading.model} (${t.name})`),
      ...stats.tenants.filter((t) => t.lifecycle && t.lifecycle.state === "starting").map((t) => `starting ${t.name}`)];
    $("device").textContent = `${d.name} · ${d.source}${stats.handoff_in_progress ? " · handoff in progress" : ""}` +
      happening.map((x) => ` · ${x}`).join("") +
      (waiting ? ` · ${waiting} request${waiting > 1 ? "s" : ""} waiting for memory` : "");
    renderBar(); renderTenants(); renderTimeline();
  }

  // A tenant the proxy starts and stops changed state: shown at once, not at the next stats frame.
  function onLifecycle(frame) {
    const t = ui.stats && ui.stats.tenants.find((x) => x.name === frame.tenant);
    if (!t) return;
    t.lifecycle = frame.lifecycle;
    renderTenants();
  }

  function onDecision(d) {
    ui.decisions.set(d.id, d);  // an update re-sends the same id
    if (ui.decisions.size > MAX_DECISIONS) ui.decisions.delete(ui.decisions.keys().next().value);
    renderDecisions();
    const story = storyOf(d);
    if (story !== null) fetchStory(story);
  }

  // -- a request's story: arrived, waited for whom, the releases, the load, the first byte -------
  // A decision of a GPU request that waited (queued) or caused a handoff (plan), or the load it
  // made: its story is asked of GET /api/decisions/{id}, which gathers it from the decision log.
  function storyOf(d) {
    const byRequest = (d.trigger || "").startsWith("request ");
    if ((d.kind === "queued" || d.kind === "plan") && byRequest) return d.id;
    if (d.kind === "model_load" && d.outcome && d.outcome.request) return d.outcome.request;
    if (d.kind === "model_load") return d.id;  // a load with no wait or handoff before it (a reload): its own story
    return null;
  }
  const storyTimers = new Map();
  function fetchStory(id) {
    clearTimeout(storyTimers.get(id));  // a burst of updates of one request: one fetch
    storyTimers.set(id, setTimeout(async () => {
      storyTimers.delete(id);
      try {
        const r = await fetch(`/api/decisions/${id}`, { cache: "no-store" });
        if (!r.ok) return;
        const body = await r.json();
        if (!body.story) return;
        // a plan seen before the wait that led to it had ended told its story under the plan's own
        // id: the request's full story (keyed by its wait) replaces it
        for (const other of body.story.related) if (other !== body.story.request) ui.stories.delete(other);
        ui.stories.set(body.story.request, body.story);
        const keep = [...ui.stories.keys()].sort((a, b) => b - a).slice(0, MAX_STORIES);
        for (const k of [...ui.stories.keys()]) if (!keep.includes(k)) ui.stories.delete(k);
        renderStories();
      } catch (err) { /* the next update asks again */ }
    }, STORY_DEBOUNCE_MS));
  }
  function renderStories() {
    const list = $("stories");
    const items = [...ui.stories.values()].sort((a, b) => b.request - a.request);
    // one time scale for every row: 1.8 s is drawn a sixth as long as 11.8 s, not as long
    const end = Math.max(0.001, ...items.map(storyEnd));
    list.dataset.scale = end.toFixed(3);
    list.replaceChildren(...(items.length ? items.map((st) => renderStory(st, end))
      : [el("li", { class: "empty", text: "no request has waited or caused a handoff yet" })]));
  }
  const storyEnd = (st) => Math.max(st.first_byte_s || 0, ...st.steps.map((x) => x.start_s + x.duration_s), 0.001);
  function renderStory(st, end) {
    const pct = (v) => `${Math.min(100, Math.max(0, (100 * v) / end)).toFixed(2)}%`;
    const onlyLoaded = st.steps.length > 0 && st.steps.every((x) => x.kind === "load");  // a reload, a cold start
    const total = st.first_byte_s !== null ? `first byte after ${st.first_byte_s.toFixed(1)} s`
      : onlyLoaded ? "waited for nothing, loaded its model" : "no answer yet";
    const rows = st.steps.map((x) => {
      const bar = el("span", { class: `bar ${x.kind}`, title: x.text });
      bar.style.setProperty("left", pct(x.start_s));
      if (x.kind !== "first_byte") bar.style.setProperty("width", pct(x.duration_s));
      return el("div", { class: "step", dataset: { step: x.kind, decision: x.decision } },
        el("span", { class: "label", text: x.text, title: x.text }), el("span", { class: "track" }, bar));
    });
    return el("li", { class: "story", dataset: { story: st.request, tenant: st.tenant } },
      el("div", { class: "story-head" }, el("time", { text: clock(st.arrived_at) }),
        el("b", { text: st.tenant }), ` ${st.trigger.replace(/^request /, "")}: ${total}`),
      el("div", { class: "waterfall" }, ...rows));
  }

  // -- memory bar ----------------------------------------------------------------------------
  function renderBar() {
    const s = ui.stats;
    const total = s.device.total_bytes || 1;
    const segs = [];
    let accounted = 0;
    for (const t of s.tenants) {
      segs.push({ key: t.name, label: t.name, bytes: t.vram_bytes || 0, raw: t.vram_bytes, color: colorOf(t), cls: "tenant" });
      accounted += t.vram_bytes || 0;
    }
    for (const p of s.processes.filter((p) => !p.tenant)) {
      const who = p.pod ? `pod ${p.pod.namespace}/${p.pod.name}` : p.name;
      segs.push({ key: `pid-${p.pid}`, label: `${who} (${p.pid}, unmanaged)`, bytes: p.vram_bytes || 0, raw: p.vram_bytes, cls: "unmanaged" });
      accounted += p.vram_bytes || 0;
    }
    const other = (s.device.used_bytes || 0) - accounted;
    if (other > 0.005 * total) segs.push({ key: "other", label: "driver / reserved", bytes: other, color: "#b9c0ca", cls: "other" });
    segs.push({ key: "free", label: "free", bytes: s.device.free_bytes || 0, raw: s.device.free_bytes, cls: "free" });

    const bar = $("membar"), legend = $("legend");
    const barWidth = bar.clientWidth;
    bar.replaceChildren(); legend.replaceChildren();
    for (const g of segs) {
      const share = g.bytes / total;
      const shown = "raw" in g ? known(g.raw) : gib(g.bytes);  // the API's null is unknown, never 0
      const name = g.label.split(" (")[0];
      // The longest label that fits the segment's width (it is drawn at its final width: the bar
      // animates towards it), else the name alone, else nothing: never a clipped label.
      const label = [`${name} ${shown}`, name].find((text) => fits(text, share * barWidth)) || "";
      const seg = el("div", { class: `seg ${g.cls}`, title: `${g.label}: ${shown}`, dataset: { segment: g.key, bytes: g.bytes } },
        label);
      seg.style.setProperty("flex-grow", String(g.bytes));
      seg.style.setProperty("flex-basis", "0");
      if (g.bytes === 0) seg.style.setProperty("min-width", "0");
      if (g.color) seg.style.setProperty("background", g.color);
      bar.append(seg);
      const swatch = el("i");
      if (g.color) swatch.style.setProperty("background", g.color);
      else if (g.cls === "unmanaged") swatch.style.setProperty("background", "#c8323c");
      else swatch.style.setProperty("background", "#d5dbe3");
      legend.append(el("li", {}, swatch, `${g.label} ${shown}`));
    }
    $("mem-total").textContent = s.device.total_bytes === null || s.device.total_bytes === undefined
      ? "card size unknown (no GPU reader)" : `${gib(s.device.used_bytes)} used of ${gib(s.device.total_bytes)}`;
    renderDevices();
  }

  const SEG_PADDING_PX = 12;  // room either side of a segment's label
  let measure = null;
  function fits(text, width) {
    if (!measure) {
      measure = document.createElement("canvas").getContext("2d");
      const style = getComputedStyle($("membar"));
      measure.font = `12px ${style.fontFamily}`;  // .seg's font size
    }
    return measure.measureText(text).width + SEG_PADDING_PX <= width;
  }

  // Several GPUs: the bar above is the whole host; one line per card says what each tenant holds there.
  function renderDevices() {
    const cards = ui.stats.device.devices || [];
    const list = $("devices");
    list.hidden = cards.length < 2;
    list.replaceChildren(...cards.map((d) => {
      const held = Object.entries(d.tenants || {}).map(([t, b]) => `${t} ${gib(b)}`).join(", ") || "nothing held";
      const size = d.total_bytes === null ? "size unknown" : `${gib(d.used_bytes)} used of ${gib(d.total_bytes)}`;
      const placed = (d.placed || []).length ? ` · placed here: ${d.placed.join(", ")}` : "";
      return el("li", { dataset: { device: d.index } }, `GPU ${d.index} ${d.name}: ${size} · ${held}${placed}`);
    }));
  }

  // -- tenant cards ----------------------------------------------------------------------------
  function engineSummary(name) {
    const e = ui.engines[name];
    if (!e) return { sub: "", tip: "" };
    if (e.error && !e.reachable) return { sub: `unreachable: ${e.error}`, tip: e.error };
    if (e.settings) {
      // Subtitle: only what differs from the defaults, and how many settings deserve a look.
      // A setting nobody could read is unknown, never "default".
      const unknown = e.settings.filter((s) => s.source === "unknown").length;
      const set = e.settings.filter((s) => s.value !== null && s.value !== undefined).map((s) => `${s.name.replace(/^OLLAMA_/, "")}=${s.value}`);
      const notes = e.settings.filter((s) => s.status && s.status !== "ok" && s.status !== "unknown").length;
      // "settings not read" says why (hover): the reads that failed, from env_sources (a process of
      // another user, nothing loaded yet, a simulated GPU...).
      const why = (e.env_sources || []).filter((r) => !r.ok && r.error).map((r) => `not read from ${r.source}: ${r.error}`);
      const base = set.length ? set.join(" ") : unknown === e.settings.length ? "settings: not visible from here (hover: why)" : "all defaults";
      const short = [base, unknown && unknown < e.settings.length ? `${unknown} unknown` : null,
        notes ? `${notes} note${notes > 1 ? "s" : ""}` : null].filter(Boolean);
      const tip = e.settings.map((s) => `${s.name} = ${s.value ?? (s.source === "unknown" ? "(unknown)" : "(not set)")} [${s.source}]${s.status && s.status !== "ok" ? ` (${s.status})` : ""}\n  ${s.meaning}`);
      return { sub: `${e.engine} ${e.version || ""} · ${short.join(" · ")}`, tip: [`${e.engine} ${e.version || ""} at ${e.upstream}`, ...(unknown ? why : []), ...tip].join("\n") };
    }
    // Flags are objects ({flag, value, meaning, status}): show each as it was typed.
    const flags = (e.flags || []).length ? e.flags.map((f) => (f.value === null || f.value === undefined ? f.flag : `${f.flag} ${f.value}`)).join(" ") : "no flags";
    const tip = [`${e.engine} ${e.version || ""} at ${e.upstream}`, `argv: ${(e.argv || []).join(" ")}`,
      ...(e.flags || []).map((f) => `${f.flag}: ${f.meaning}`),
      e.device_name ? `device: ${e.device_name}` : null, e.pytorch_version ? `pytorch ${e.pytorch_version}` : null,
      e.python_version ? `python ${e.python_version}` : null].filter(Boolean);
    return { sub: `${e.engine} ${e.version || ""} · ${flags}`, tip: tip.join("\n") };
  }

  function renderTenants() {
    const s = ui.stats;
    if (!s) return;
    const box = $("tenants");
    const active = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset : {};
    const focusKey = ["release", "start", "stop"].find((k) => active[k]);
    const focused = focusKey ? `[data-${focusKey}="${CSS.escape(active[focusKey])}"]` : null;
    box.replaceChildren();
    for (const t of s.tenants) {
      const eng = engineSummary(t.name);
      const cat = ui.catalog[t.name];
      const models = cat ? (cat.error ? `catalog error: ${cat.error}` : `${cat.models.length} installed`) : null;
      const state = t.busy ? `busy: ${t.busy_reason}` : `idle${t.busy_reason && t.busy_reason !== "idle" ? `: ${t.busy_reason}` : ""}`;
      const release = el("button", { type: "button", dataset: { release: t.name }, disabled: !t.reclaimable,
        title: t.reclaimable ? `release ${t.name}'s GPU memory now` : "this tenant has no release strategy" }, "Release");
      release.addEventListener("click", () => doRelease(t.name));
      const lc = t.lifecycle;
      const sp = t.suspension && (t.suspension.state !== "running" || t.suspension.error) ? t.suspension : null;  // cuda_suspend
      const lifecycleButtons = lc ? lifecycleActions(t) : [];
      const res = ui.results.get(t.name);
      const waits = t.waiting || [];
      const waitText = waits.map((w) => `${place(w)}${w.trigger}, ${secs(w.waited_s)}: ${waitReason(w)}`).join("\n");
      // A request waiting for memory is counted in flight, but it does no work on the card: a tenant
      // whose only requests wait is "waiting", not busy.
      const jobs = t.jobs || [];
      const running = Math.max(0, t.in_flight - waits.length);
      const onlyWaiting = waits.length > 0 && running === 0 && jobs.length === 0;
      const holding = onlyWaiting && waits.every((w) => heldOf(w));  // only held: a short pause by choice
      const pill = holding ? "held" : onlyWaiting ? "waiting" : t.busy ? "busy" : "idle";
      const ld = t.loading;
      const starting = lc && lc.state === "starting";
      const stateText = ld ? `loading ${ld.model}` : starting ? `starting the app (${secs(lc.for_s)})`
        : holding ? waitReason(waits[0]) : onlyWaiting ? `waiting for memory: ${waits[0].reason}` : state;
      const flight = [running ? `${running} request${running > 1 ? "s" : ""}` : null,
        jobs.length ? `${jobs.length} job${jobs.length > 1 ? "s" : ""}` : null,
        waits.length ? `${waits.length} waiting` : null].filter(Boolean).join(", ") || "0";
      // The idle release counts from the last activity; while the tenant works it cannot happen.
      const idleRelease = t.idle_release_in_s === null ? "off"
        : t.busy ? `not while ${onlyWaiting ? "waiting" : "busy"} (counts from its last activity)` : `in ${secs(t.idle_release_in_s)}`;
      const pods = [...new Set(s.processes.filter((p) => p.tenant === t.name && p.pod).map((p) => `${p.pod.namespace}/${p.pod.name}`))];
      const card = el("article", { class: "card", dataset: { tenant: t.name, busy: t.busy, waiting: waits.length, state: pill } },
        el("div", { class: "top" }, el("h3", { text: t.name }),
          waits.length && !onlyWaiting ? el("span", { class: "pill waiting", text: `${waits.length} waiting`, title: waitText }) : null,
          lc ? el("span", { class: `pill lc ${lc.state}`, text: lc.state, dataset: { role: "lifecycle", state: lc.state },
            title: lifecycleTip(lc) }) : null,
          el("span", { class: `pill ${pill}`, text: pill, title: onlyWaiting ? waitText : null, dataset: { role: "state" } })),
        el("div", { class: "sub", title: eng.tip || null, dataset: { role: "engine" } }, eng.sub || t.engine),
        el("dl", {},
          el("dt", { text: "state" }), el("dd", { text: stateText, dataset: { role: "state-text" } }),
          lc ? el("dt", { text: "app" }) : null,
          lc ? el("dd", { text: lifecycleText(lc), title: lifecycleTip(lc), dataset: { role: "app" } }) : null,
          sp ? el("dt", { text: "host RAM" }) : null,
          sp ? el("dd", { text: sp.error ? `${sp.state}: ${sp.error}` : `${sp.state}: ${(sp.parked_bytes / 2 ** 30).toFixed(1)} GiB parked (${sp.via})`,
            title: sp.fix || null, dataset: { role: "suspension", state: sp.state } }) : null,
          ld ? el("dt", { text: "loading" }) : null,
          ld ? el("dd", { text: loadText(ld), title: loadTip(ld), dataset: { role: "loading", model: ld.model } }) : null,
          waits.length ? el("dt", { text: "waiting" }) : null,
          waits.length ? el("dd", { text: `${place(waits[0])}${secs(waits[0].waited_s)}: ${waitReason(waits[0])}`, title: waitText, dataset: { role: "waiting", held: heldOf(waits[0]) ? "true" : "false" } }) : null,
          el("dt", { text: "in flight" }), el("dd", { text: flight + (t.stale_jobs.length ? ` (${t.stale_jobs.length} stale)` : ""),
            title: jobs.length ? `jobs: ${jobs.join(", ")}` : null, dataset: { role: "in-flight" } }),
          el("dt", { text: "memory" }), el("dd", { text: gib(t.vram_bytes), dataset: { role: "vram" } }),
          pods.length ? el("dt", { text: pods.length > 1 ? "pods" : "pod" }) : null,
          pods.length ? el("dd", { text: pods.join(", "), dataset: { role: "pods" } }) : null,
          el("dt", { text: "idle release" }), el("dd", { text: idleRelease, dataset: { role: "idle-release" } }),
          models ? el("dt", { text: "models" }) : null, models ? el("dd", { text: models, title: cat.models.map((m) => m.name).join("\n") }) : null),
        el("div", { class: "actions" }, release, ...lifecycleButtons,
          res ? el("span", { class: `result ${res.cls}`, text: res.text, dataset: { role: "result", result: res.cls } }) : null));
      card.style.setProperty("--c", colorOf(t));
      box.append(card);
    }
    if (focused) { const b = box.querySelector(focused); if (b) b.focus(); }
  }

  // "#2 in line, " (the queue's order: priority, then arrival)
  const place = (w) => (w.position ? `#${w.position} in line, ` : "");
  // A held swap is a choice, not a wait for busy work (proxy/handoff/policy.py's reason, read back)
  const HELD = /^holding the swap of (.+?) for ([\d.e+-]+) s \(proxy\.swap_hold_s/;
  const heldOf = (w) => { const m = HELD.exec(w.reason || ""); return m ? { tenants: m[1], s: parseFloat(m[2]) } : null; };
  const waitReason = (w) => {
    const h = heldOf(w);
    return h ? `kept ${h.tenants} on the card ${h.s.toFixed(1)} s by choice: just used, a request for it may follow` : w.reason;
  };
  // "gemma3:27b, 8.1 of 17.2 GiB (estimated), 6 s": how far a load got on the card, and for how long
  function loadText(ld) {
    const got = ld.on_card_bytes === null ? "on the card: unknown" : `${gib(ld.on_card_bytes)} of ${gib(ld.need_bytes)}`;
    return `${ld.model}, ${got}${ld.estimated && ld.on_card_bytes !== null ? " (estimated)" : ""}, ${secs(ld.elapsed_s)}`;
  }
  function loadTip(ld) {
    return ld.estimated ? "estimated: the card shows what the tenant's processes hold, not which model the memory is for "
      + "(it held other memory when this load began), or no GPU reader measured it"
      : "what the tenant gained on the card since the load began, of what the proxy planned for it";
  }

  // -- tenants the proxy starts and stops --------------------------------------------------------
  function lifecycleText(lc) {
    const base = `${lc.state} for ${secs(lc.for_s)}`;
    if (lc.state === "failed") return `${base}: ${lc.error || "start failed"}${lc.retry_in_s ? ` (next try in ${secs(lc.retry_in_s)})` : ""}`;
    return base;
  }
  function lifecycleTip(lc) {
    const c = lc.controller || {};
    const what = c.kind === "process" ? `process: ${(c.command || []).join(" ")}` : c.kind === "systemd" ? `systemd unit ${c.unit} (${c.scope})`
      : c.kind === "docker" ? `docker container ${c.container} at ${c.socket}` : c.kind;
    return [what, lc.error ? `error: ${lc.error}` : null, lc.fix ? `fix: ${lc.fix}` : null,
      lc.output && lc.output.length ? `last output:\n${lc.output.slice(-10).join("\n")}` : null].filter(Boolean).join("\n");
  }
  function lifecycleActions(t) {
    const lc = t.lifecycle;
    const start = el("button", { type: "button", dataset: { start: t.name }, disabled: lc.state === "running" || lc.state === "starting",
      title: lc.state === "running" ? `${t.name} runs` : `start ${t.name} now (its GPU memory is made free first)` }, "Start");
    start.addEventListener("click", () => doLifecycle("start", t.name));
    const busy = t.busy || t.in_flight > 0;
    const stop = el("button", { type: "button", dataset: { stop: t.name },
      disabled: lc.state === "stopped" || lc.state === "stopping" || lc.state === "starting" || busy,
      title: busy ? "a busy tenant is never stopped" : `stop ${t.name}; its next request starts it again` }, "Stop");
    stop.addEventListener("click", () => doLifecycle("stop", t.name));
    return [start, stop];
  }
  async function doLifecycle(action, name) {
    if (action === "stop" && !window.confirm(`Stop ${name}? Its next request starts it again.`)) return;
    ui.results.set(name, { cls: "none", text: action === "start" ? "starting…" : "stopping…" }); renderTenants();
    const headers = {};
    const token = localStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    let result;
    try {
      const r = await fetch(`/api/tenants/${encodeURIComponent(name)}/${action}`, { method: "POST", headers });
      const body = await r.json().catch(() => ({}));
      if (r.ok && body.note) result = { cls: "none", text: body.note };
      else if (r.ok && action === "start") result = { cls: "ok", text: `started, ready in ${body.report ? body.report.duration_s : "?"} s` };
      else if (r.ok) result = { cls: "ok", text: `stopped${body.release ? `: freed ${body.release.freed_gb} GiB in ${body.release.duration_s} s` : ""}` };
      else {
        const last = body.output && body.output.length ? ` (last output: ${body.output[body.output.length - 1]})` : "";
        result = { cls: "err", text: `${r.status}: ${body.error || r.statusText}${last}` };
      }
      const t = ui.stats && ui.stats.tenants.find((x) => x.name === name);
      if (t && body.lifecycle) t.lifecycle = body.lifecycle;
    } catch (err) {
      result = { cls: "err", text: `request failed: ${err}` };
    }
    ui.results.set(name, result); renderTenants();
  }

  async function doRelease(name) {
    if (!window.confirm(`Release ${name}'s GPU memory now? Its models will be unloaded.`)) return;
    ui.results.set(name, { cls: "none", text: "releasing…" }); renderTenants();
    const headers = {};
    const token = localStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    let result;
    try {
      const r = await fetch(`/api/tenants/${encodeURIComponent(name)}/release`, { method: "POST", headers });
      const body = await r.json().catch(() => ({}));
      if (r.ok) result = releaseResult(body);
      else if (body.freed_gb !== undefined) result = { cls: "err", text: `${r.status}: freed ${body.freed_gb} GiB in ${body.duration_s} s: ${body.error || "not confirmed"}` };
      else result = { cls: "err", text: `${r.status}: ${body.error || r.statusText}${body.reason ? ` (${body.reason})` : ""}` };
    } catch (err) {
      result = { cls: "err", text: `request failed: ${err}` };
    }
    ui.results.set(name, result); renderTenants();
  }

  // A 200 is not always good news: green only when the card showed memory back.
  function releaseResult(body) {
    if (body.reason === "cpu") return { cls: "none", text: body.note || "nothing to release: it runs on the CPU" };
    if (body.estimated) return { cls: "warn", text: `estimated: ${body.freed_gb} GiB freed in ${body.duration_s} s by the engine's own report (the card was not read)` };
    if (!body.freed_bytes) return { cls: "none", text: `freed nothing (0 GiB) in ${body.duration_s} s` };
    return { cls: "ok", text: `freed ${body.freed_gb} GiB in ${body.duration_s} s` };
  }

  // -- health ------------------------------------------------------------------------------------
  async function pollHealth() {
    try {
      const r = await fetch("/api/health", { cache: "no-store" });
      ui.health = await r.json();
    } catch (err) {
      ui.health = { status: "unreachable", entries: [{ name: "admin API", status: "failed", problem: String(err), impact: "the dashboard cannot read the proxy", fix: "is hyperswap running?" }] };
    }
    renderHealth();
  }
  function renderHealth() {
    const h = ui.health, badge = $("health-badge"), panel = $("health");
    const bad = (h.entries || []).filter((e) => e.status !== "ok");
    badge.dataset.status = h.status;
    badge.textContent = h.status === "ok" ? "health: ok" : `health: ${h.status} (${bad.length})`;
    const open = bad.length > 0 && !ui.healthCollapsed;  // collapsed when all is well
    badge.setAttribute("aria-expanded", String(open));
    panel.hidden = !open;
    panel.classList.toggle("degraded", h.status === "degraded");
    panel.replaceChildren(el("h2", { text: `Health: ${h.status}` }), ...bad.map((e) => el("div", { class: "health-entry", dataset: { check: e.name } },
      el("div", {}, el("span", { class: `st ${e.status}`, text: e.status }), el("b", { text: e.name }), e.problem || ""),
      e.impact ? el("div", { class: "impact" }, el("span", { class: "muted", text: "impact: " }), e.impact) : null,
      e.fix ? el("div", { class: "fix" }, el("span", { class: "muted", text: "fix: " }), el("code", { text: e.fix })) : null)));
  }

  async function pollEngines() {
    try {
      const r = await fetch("/api/engines", { cache: "no-store" });
      const body = await r.json();
      ui.engines = Object.fromEntries((body.engines || []).map((e) => [e.tenant, e]));
      renderTenants();
    } catch (err) { /* the cards keep their last subtitle */ }
  }

  // -- model files in RAM ------------------------------------------------------------------------
  async function pollModels() {
    try {
      const [m, l] = await Promise.all([fetch("/api/models", { cache: "no-store" }), fetch("/api/models/loads", { cache: "no-store" })]);
      if (m.ok) ui.models = await m.json();
      if (l.ok) ui.loads = await l.json();
      renderModels();
    } catch (err) { /* the table keeps its last state */ }
  }
  function residencyCell(r) {
    if (r.resident_percent === null) return el("td", { class: "unknown", title: r.unknown_reason || "", text: "unknown" });
    return el("td", { class: r.resident_percent >= 90 ? "hot" : null, text: `${r.resident_percent} %` });
  }
  function renderModels() {
    const body = $("models").tBodies[0], m = ui.models;
    if (!m) return;
    $("models-mem").textContent = m.mem_available_bytes === null ? "MemAvailable unknown"
      : `MemAvailable ${gib(m.mem_available_bytes)}, warming stops at ${gib(m.warm_margin_bytes)}`;
    const rows = [];
    for (const t of m.tenants) {
      if (t.unknown_reason || t.problems.length) rows.push(el("tr", { dataset: { tenant: t.tenant } }, el("td", { text: t.tenant }),
        el("td", { colspan: "5", class: "unknown", text: t.unknown_reason || t.problems.map((p) => `${p.problem} (fix: ${p.fix})`).join("; ") })));
      for (const x of t.models) {
        const w = x.warm, active = w && (w.state === "running" || w.state === "queued");
        const btn = el("button", { type: "button", dataset: { model: x.key }, text: active ? "stop" : "warm" });
        btn.addEventListener("click", () => warmAction(active ? "stop" : "warm", x.tenant, x.name));
        rows.push(el("tr", { dataset: { model: x.key } }, el("td", { text: x.tenant }), el("td", { text: x.name }),
          el("td", { text: gib(x.size_bytes) }), residencyCell(x.residency),
          el("td", { title: w && w.stop_reason ? w.stop_reason : "", text: w ? `${w.state} (${w.reason})` : "–" }), el("td", {}, btn)));
      }
    }
    body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: "6", class: "empty", text: "no model files found" }))]));
    const loads = (ui.loads && ui.loads.loads) || [], th = ui.loads && ui.loads.thresholds;
    const last = loads.slice(-5).reverse().map((r) => `${r.model} ${r.gbps} GB/s ${r.class || "?"}`).join(" · ");
    $("loads").textContent = loads.length ? `loads: ${last}${th && th.split_gbps ? ` — warm/cold split ${th.split_gbps} GB/s (measured here)` : ""}` : "no model loads timed yet";
  }
  async function warmAction(action, tenant, model) {
    const headers = { "Content-Type": "application/json" };
    const token = localStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    try {
      await fetch(`/api/models/${action}`, { method: "POST", headers, body: JSON.stringify({ tenant, model }) });
    } catch (err) { /* shown by the next poll */ }
    pollModels();
  }

  // -- timeline ----------------------------------------------------------------------------------
  function renderTimeline() {
    const svg = $("timeline"), legend = $("timeline-legend");
    const W = 600, H = 140, now = Date.now();
    // The window grows with the page's age up to HISTORY_MS, so a fresh page is not one spike at the right edge.
    const span = Math.min(HISTORY_MS, Math.max(60000, ui.history.length ? now - ui.history[0].t : 0));
    // Card size unknown (no GPU reader): scale to the largest holding drawn instead.
    const peak = Math.max(1, ...ui.history.flatMap((h) => Object.values(h.v).map((v) => v || 0)));
    const total = (ui.stats && ui.stats.device.total_bytes) || peak;
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    for (const f of [0.25, 0.5, 0.75]) {
      const line = document.createElementNS(ns, "line");
      line.setAttribute("class", "grid");
      line.setAttribute("x1", "0"); line.setAttribute("x2", String(W));
      line.setAttribute("y1", String(H * f)); line.setAttribute("y2", String(H * f));
      svg.append(line);
    }
    legend.replaceChildren();
    for (const t of (ui.stats ? ui.stats.tenants : [])) {
      // Steps, not slopes: a frame's value holds until the next frame.
      const pts = [];
      ui.history.forEach((h, i) => {
        const x = (W * (1 - (now - h.t) / span)).toFixed(1), y = (H - 4 - (H - 8) * (h.v[t.name] || 0) / total).toFixed(1);
        if (i > 0) pts.push(`${x},${pts[pts.length - 1].split(",")[1]}`);
        pts.push(`${x},${y}`);
      });
      const pl = document.createElementNS(ns, "polyline");
      pl.setAttribute("points", pts.join(" "));
      pl.setAttribute("stroke", colorOf(t));
      pl.dataset.tenant = t.name;
      svg.append(pl);
      const sw = el("i"); sw.style.setProperty("background", colorOf(t));
      legend.append(el("li", {}, sw, `${t.name} ${gib(t.vram_bytes)}`));
    }
    legend.append(el("li", { text: `scale: 0 – ${gib(total)}` }));
    $("timeline-start").textContent = `−${Math.round(span / 60000)} min`;
  }

  // A page opened (or reloaded) mid-session draws the last minutes from the telemetry store
  // instead of starting empty: one point per recorded window (10 s), each tenant's last value in it.
  async function backfillTimeline() {
    try {
      const since = (Date.now() - HISTORY_MS) / 1000;
      const r = await fetch(`/api/history?kind=vram&since=${since}&limit=5000`, { cache: "no-store" });
      if (!r.ok) return;  // telemetry off: the timeline fills from the stream alone
      const rows = ((await r.json()).rows || {}).vram || [];
      const firstLive = ui.history.length ? ui.history[0].t : Infinity;
      const past = [];
      let v = {};
      for (const row of rows) {  // oldest first; tenants' windows need not line up, so values carry forward
        const t = Math.round((row.at + row.window_s) * 1000);
        if (t >= firstLive) break;
        v = { ...v, [row.tenant]: row.last_bytes };
        if (past.length && past[past.length - 1].t === t) past[past.length - 1].v = v;
        else past.push({ t, v, total: null });
      }
      ui.history.unshift(...past);
      renderTimeline();
    } catch (err) { /* the stream still fills the timeline */ }
  }

  // -- decisions ---------------------------------------------------------------------------------
  function describe(d) {
    const o = d.outcome || {}, p = d.plan;
    const rel = (o.releases || []).map((r) => `${r.tenant}: freed ${r.freed_gb} GiB in ${r.duration_s} s${r.confirmed ? "" : r.estimated && !r.error ? " (estimated: the engine's own report, the card was not read)" : ` (${r.error || "not confirmed"})`}`);
    const blockers = p && p.blockers && p.blockers.length ? `blocked by ${p.blockers.map((b) => `${b.name} (${[b.tenant !== b.reason ? b.tenant : null, b.reason, b.vram_gib !== null ? `${b.vram_gib} GiB` : null].filter(Boolean).join(", ")})`).join(", ")}` : "";
    switch (d.kind) {
      case "plan":
        return `${d.tenant} needs ${p ? p.need_gib : "?"} GiB (free ${p ? p.free_gib : "?"}): ${p && p.releases.length ? "release " + p.releases.map((r) => `${r.tenant} ~${r.expected_free_gib} GiB`).join(", ") : "nothing to release"}${rel.length ? " → " + rel.join("; ") : " (running…)"}`;
      case "release": case "idle_release":
        if (o.result) return `${d.tenant} (${d.trigger}): ${o.result}`;
        return `${d.tenant} release (${d.trigger}): ${rel.length ? rel.join("; ") : `held ${gib(o.held_bytes)}, releasing…`}`;
      case "rejection":
        return `${o.status || 507} for ${d.tenant} (${d.trigger})${p ? `: needs ${p.need_gib} GiB, free ${p.free_gib} GiB` : ""}${blockers ? "; " + blockers : ""}${o.reason ? "; " + o.reason : ""}`;
      case "model_load":
        return `${d.tenant} loaded ${o.model}: ${gib(o.size_bytes)} in ${o.seconds} s = ${o.gbps} GB/s, ${o.class || "unclassified"} (${o.resident_before_percent === null ? "residency unknown" : `${o.resident_before_percent} % in RAM before`})`;
      case "queued": {
        const held = heldOf(o);
        if (held) {  // a held swap: the choice and why, never "waits behind" an idle tenant
          const kept = `${d.tenant} (${d.trigger}): kept ${held.tenants} on the card by choice (just used, a request for it may follow)`;
          return o.result ? `${kept}, ${secs(o.waited_s)}, then ${o.result === "admitted" ? "swapped" : o.result}` : kept;
        }
        const behind = (o.waiting_for || []).length ? `behind ${o.waiting_for.join(", ")}` : o.behind ? `behind request #${o.behind}` : "in the queue";
        const why = o.ended_with || o.reason;
        if (!o.result) return `${d.tenant} (${d.trigger}) waits for memory ${behind}${o.reason ? `: ${o.reason}` : ""}`;
        const waited = secs(o.waited_s);
        if (o.result === "admitted") return `${d.tenant} (${d.trigger}) waited ${waited} ${behind}, then ran${why ? ` (${why})` : ""}`;
        if (o.result === "client left while waiting") return `${d.tenant} (${d.trigger}): the client left after waiting ${waited} ${behind}`;
        return `${d.tenant} (${d.trigger}) waited ${waited} ${behind}, then ${o.result}${why ? `: ${why}` : ""}`;
      }
      case "stale_job":
        return `${d.tenant}: job ${o.job_id} no longer counted as running: ${o.reason}`;
      case "spill":
        if (o.result) return `${d.tenant} spills to the CPU: ${o.result}`;
        return `${d.tenant} spills to the CPU: ${rel.length ? "released " + rel.join("; ") : "releasing…"}`;
      case "oom_retry":
        // a ComfyUI prompt's retry: "requeued", then how its new run ended (oom_retry)
        return `${d.tenant} OOM (${d.trigger}): ${typeof o.result === "string" ? o.result : JSON.stringify(o.result ?? o)}${
          typeof o.oom_retry === "string" ? ` → ${o.oom_retry}` : ""}`;
      case "gpu_drift":  // proxy/gpu/keeper.py
        return o.drifting && o.drifting.length ? `GPU ${o.device}: ${o.drifting.map((c) => c.note).join("; ")}`
          : `GPU ${o.device}: settings match gpu_profile again (${(o.resolved || []).join(", ")})`;
      case "gpu_apply":
        return `GPU ${o.device} ${d.trigger}: ${(o.changes || []).join(", ")}${o.ok === true ? " → done" : o.ok === false
          ? ` → failed: ${(o.errors || []).map((e) => e.error).join("; ") || "still off: " + (o.still_drifting || []).join(", ")}` : " (writing…)"}`;
      case "start":  // a tenant the proxy starts (proxy/handoff/lifecycles.py)
        if (o.ok) return `${d.tenant} started, ready in ${o.duration_s} s`;
        return `${d.tenant} start failed after ${o.duration_s} s: ${o.error || "?"}${o.output && o.output.length ? ` (last output: ${o.output[o.output.length - 1]})` : ""}`;
      case "stop":
        return o.ok ? `${d.tenant} stopped in ${o.duration_s} s` : `${d.tenant} stop failed: ${o.error || "?"}`;
      case "exit":  // it ended on its own while running (the supervisor noticed)
        return `${d.tenant} ${d.outcome.state === "exited" ? "exited" : "crashed"}: ${o.error || "?"}${o.output && o.output.length ? ` (last output: ${o.output[o.output.length - 1]})` : ""}${o.restart_in_s != null ? `; restarting in ${o.restart_in_s} s` : ""}`;
      case "resume":
        return o.ok ? `${d.tenant} resumed in ${o.duration_s} s` : `${d.tenant} resume failed: ${o.error || "?"}`;
      default:
        return `${d.tenant} (${d.trigger}) ${Object.keys(o).length ? JSON.stringify(o) : ""}`;
    }
  }
  // A release's badge says how it ended: "released" (green) only when the card showed memory back.
  function releaseState(d) {
    const o = d.outcome || {}, rels = o.releases || [];
    if (o.result) return ["nothing", "nothing to release"];
    if (!rels.length) return ["pending", "releasing"];
    if (rels.some((r) => r.error)) return ["failed", "release failed"];
    if (rels.some((r) => !r.confirmed)) return ["estimated", "estimated"];
    if (!rels.some((r) => r.freed_bytes > 0)) return ["nothing", "freed nothing"];
    return ["released", "released"];
  }
  function kindBadge(d) {
    if (d.kind !== "release" && d.kind !== "idle_release") return el("span", { class: `kind ${d.kind}`, text: d.kind.replace("_", " ") });
    const [state, text] = releaseState(d);
    return el("span", { class: `kind ${d.kind} r-${state}`, text: d.kind === "idle_release" ? `idle: ${text}` : text, dataset: { result: state } });
  }
  function renderDecisions() {
    const list = $("decisions");
    const items = [...ui.decisions.values()].sort((a, b) => b.id - a.id);
    list.replaceChildren(...(items.length ? items.map((d) => el("li", { dataset: { decision: d.id, kind: d.kind } },
      el("time", { text: clock(d.at) }), kindBadge(d), el("span", { text: describe(d) })))
      : [el("li", { class: "empty", text: "no decisions yet" })]));
  }

  // -- start -------------------------------------------------------------------------------------
  function start() {
    const token = $("token");
    token.value = localStorage.getItem(TOKEN_KEY) || "";
    token.addEventListener("change", () => { if (token.value) localStorage.setItem(TOKEN_KEY, token.value); else localStorage.removeItem(TOKEN_KEY); });
    $("health-badge").addEventListener("click", () => { ui.healthCollapsed = !ui.healthCollapsed; if (ui.health) renderHealth(); });
    renderDecisions(); renderStories();
    fetch("/api/decisions?limit=50").then((r) => r.json()).then((b) => (b.decisions || []).forEach(onDecision)).catch(() => {});
    ui.lastFrameAt = Date.now();  // stale only after STALE_AFTER_MS without a frame, not before the first one
    connect();
    backfillTimeline();
    pollHealth(); setInterval(pollHealth, HEALTH_POLL_MS);
    pollEngines(); setInterval(pollEngines, ENGINES_POLL_MS);
    pollModels(); setInterval(pollModels, MODELS_POLL_MS);
    setInterval(markStale, 500);
  }
  document.addEventListener("DOMContentLoaded", start);
})();
