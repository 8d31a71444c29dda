// HyperSwap dashboard: the GPU panel (GET /api/gpu). The card's own settings per device and, with a
// gpu_profile, each setting against it. Unknown is shown as "–" with the reason on hover, never as 0.
"use strict";
(() => {
  const POLL_MS = 5000;
  const $ = (id) => document.getElementById(id);
  const { el } = window.hyperswapDom;  // from app.js
  const unknown = (s, field) => el("span", { class: "muted", title: (s.unavailable || {})[field] || "not read", text: "–" });
  const val = (s, field, fmt) => (s[field] === null || s[field] === undefined ? unknown(s, field) : fmt(s[field]));
  const range = (r, unit) => (r ? ` (${r[0]}–${r[1]} ${unit})` : "");
  const signed = (v) => `${v > 0 ? "+" : ""}${v} MHz`;

  function settingsRows(s) {
    const fans = s.fans === null ? unknown(s, "fans")
      : s.fans.length ? s.fans.map((f) => `${f.speed_percent === null ? "–" : f.speed_percent + " %"} ${f.policy || "?"}`).join(", ") : "none";
    return [
      ["power limit", val(s, "power_limit_w", (v) => `${v} W${range(s.power_limit_range_w, "W")}, default ${s.power_limit_default_w ?? "–"} W`)],
      ["power draw", val(s, "power_draw_w", (v) => `${v} W`)],
      ["clocks", val(s, "graphics_clock_mhz", (v) => `${v} / ${s.memory_clock_mhz ?? "–"} MHz (max ${s.max_graphics_clock_mhz ?? "–"} / ${s.max_memory_clock_mhz ?? "–"})`)],
      ["application clocks", val(s, "applications_graphics_clock_mhz", (v) => `${v} / ${s.applications_memory_clock_mhz ?? "–"} MHz`)],
      ["locked clocks", val(s, "locked_clocks_mhz", (v) => `${v[0]}–${v[1]} MHz`)],
      ["clock offsets", val(s, "gpc_clock_offset_mhz", (v) => `graphics ${signed(v)}, memory ${s.mem_clock_offset_mhz === null ? "–" : signed(s.mem_clock_offset_mhz)}`)],
      ["fans", fans],
      ["persistence mode", val(s, "persistence_mode", (v) => (v ? "on" : "off"))],
      ["temperature", val(s, "temperature_c", (v) => `${v} °C`)],
      ["clocks held by", val(s, "clock_event_reasons", (v) => (v.length ? v.join(", ").replaceAll("_", " ") : "nothing"))],
    ];
  }

  function render(body) {
    const panel = $("gpu-settings");
    if (!panel) return;
    const parts = [el("h2", { text: "GPU settings " }, el("span", { class: "muted", text: body.profile ? (body.apply && body.apply.enabled ? "profile applied" : "profile compared (apply off)") : "read only" }))];
    if (body.source_error || body.list_error) parts.push(el("p", { class: "empty", text: body.source_error || body.list_error.error }));
    for (const dev of body.devices || []) {
      const s = dev.settings;
      const head = el("h3", { text: `GPU ${dev.index}${s ? ": " + s.name : ""}` });
      if (!s) { parts.push(head, el("p", { class: "empty", text: dev.error ? `${dev.error.error} (fix: ${dev.error.fix})` : "not read yet" })); continue; }
      const dl = el("dl", { class: "gpu-dl" });
      for (const [k, v] of settingsRows(s)) dl.append(el("dt", { text: k }), el("dd", {}, v));
      parts.push(head, dl);
      if (dev.profile) {
        parts.push(el("ul", { class: "gpu-profile" }, ...dev.profile.map((c) => el("li", { dataset: { setting: c.setting, status: c.status } },
          el("span", { class: `st ${c.status}`, text: c.status }), el("b", { text: c.setting }), " ", c.note,
          c.cost ? el("div", { class: "muted", text: c.cost }) : null))));
      }
    }
    const err = body.apply && body.apply.error;
    if (err) parts.push(el("p", { class: "gpu-apply-error" }, `apply failed: ${err.error} `, el("code", { text: err.fix })));
    panel.replaceChildren(...parts);
  }

  async function poll() {
    try {
      const r = await fetch("/api/gpu", { cache: "no-store" });
      if (r.ok) render(await r.json());
    } catch (err) { /* the panel keeps its last view */ }
  }
  document.addEventListener("DOMContentLoaded", () => { poll(); setInterval(poll, POLL_MS); });
})();
