"""What the proxy knows of one Ollama's models: their files (`/api/tags`: size and digest), and what
each load took on the card as Ollama reported it (`/api/ps`), kept true as the models change.

A footprint is one load of one model's content with its load options: Ollama keeps one runner per
model file and reloads it when a request's runner options differ (`num_ctx`, `num_batch`, `num_gpu`,
`main_gpu`, `use_mmap`, `num_thread`, `draft_num_predict`, and the request's `shift`: server/sched.go
`needsReload`). A `num_ctx` 32768 load of gemma3:27b showed 22.5 GiB where the default one showed
17.2: each is planned on its own figure, and a request of one shape never finds the other "on the
card". So a footprint is keyed by the model's digest (the manifest digest `/api/tags` and `/api/ps`
both report) and the load options the request sets (`Shape`).

Which shape a row of `/api/ps` is: the shape of the last request for the model that the engine
answered (the listener tells the adapter), when the row's `context_length` agrees with it (for a
default one: the context default loads of this digest showed, or any on the first row after a
default answer, since the default changes with Ollama's version and settings); else the default
shape when the row's context is the one default loads of this digest showed; else the context the
row shows (`num_ctx=<context_length>`). So a load under way with other options is never taken for
the one answered before it.

A footprint goes stale when the content behind a name changes: a pull, copy, create or delete passing
through (the name is forgotten and `/api/tags` read again), or `/api/tags` showing the name with a new
digest. Footprints of a digest stay true for that content whatever name it has. A row that Ollama
split across the GPU and the CPU (`size_vram < size`) is learned as "does not fit at less than
`size`". Footprints are kept in the proxy's state folder (one small JSON file per tenant, written
atomically when they change, read at start; a bad file is ignored with a warning), so a restarted
proxy plans the first request on what the model really took, not on its file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from proxy.config.schema import Tenant
from proxy.engines.common import upstream_of

log = logging.getLogger("hyperswap.engines")

# Request options Ollama loads a model with (api.Runner): a request whose value differs from the
# loaded runner's reloads the model, with another footprint.
LOAD_OPTIONS = frozenset({"num_ctx", "num_gpu", "num_batch", "main_gpu", "use_mmap", "num_thread",
                          "draft_num_predict"})

Shape = tuple[tuple[str, str], ...]  # (option, its JSON value), sorted: the load options a request sets
FILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one load took as Ollama reported it: `size` bytes, wholly on the GPU, or (`spilled`) split
    across the GPU and the CPU, so the whole of it needs at least that much."""

    bytes: int
    spilled: bool = False


def _value(v: object) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return json.dumps(v, sort_keys=True)


def load_shape(data: dict[str, object]) -> Shape:
    """The load options a request body sets. `num_gpu` below 0 never reloads (Ollama compares it as
    equal to any): left out, like an option not set."""
    options = data.get("options")
    out: list[tuple[str, str]] = []
    if isinstance(options, dict):
        for name in sorted(LOAD_OPTIONS & options.keys()):
            v = options[name]
            if v is None or (name == "num_gpu" and isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0):
                continue
            out.append((name, _value(v)))
    if isinstance(data.get("shift"), bool):
        out.append(("shift", _value(data["shift"])))
    return tuple(out)


def variant(digest: str | None, shape: Shape) -> str:
    """The part of a load key after its model: the content (a digest's first 12 hex) and the shape."""
    return "&".join(([f"d={digest[:12]}"] if digest else []) + [f"{k}={v}" for k, v in shape])


def canonical(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _digest(value: object) -> str | None:
    return value.removeprefix("sha256:") if isinstance(value, str) and value else None


class OllamaCatalog:
    """Installed model sizes and digests from /api/tags (read again when a name is missing or was
    forgotten), and each load's footprint from /api/ps, per digest and shape."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.digests: dict[str, str] = {}
        self.footprints: dict[tuple[str, Shape], Footprint] = {}  # (digest, or "name:<model>"; shape)
        self.default_context: dict[str, int] = {}  # digest -> the context_length its default loads showed
        self._answered: dict[str, Shape] = {}  # model -> the shape of the last request the engine answered
        self._fresh_default: set[str] = set()  # models a default request was answered for since their last row
        self.path: Path | None = None

    # -- what passes through ---------------------------------------------------------------------
    def identity(self, model: str) -> str:
        return self.digests.get(model) or f"name:{model}"

    def answered(self, model: str, shape: Shape) -> None:
        """The engine answered a request for `model` with these load options: that runner is loaded now."""
        name = canonical(model)
        self._answered[name] = shape
        if shape:
            self._fresh_default.discard(name)
        else:
            self._fresh_default.add(name)

    def forget(self, model: str | None) -> None:
        """A name whose content may have changed (None: any): read /api/tags again before planning it."""
        names = [canonical(model)] if model else list(self.sizes.keys() | self.digests.keys() | self._answered.keys())
        for name in names:
            self.sizes.pop(name, None)
            self.digests.pop(name, None)
            self._answered.pop(name, None)
            self._fresh_default.discard(name)
            dropped = [k for k in self.footprints if k[0] == f"name:{name}"]
            for k in dropped:
                del self.footprints[k]
            if dropped:
                self._save()

    def saw_tags(self, models: list[object]) -> None:
        """An /api/tags answer (the proxy's own read, or a client's passing through): a name with a new
        digest is another model now; a name gone is forgotten."""
        sizes: dict[str, int] = {}
        digests: dict[str, str] = {}
        for m in models:
            if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                continue
            name = canonical(m["name"])
            if isinstance(m.get("size"), int):
                sizes[name] = m["size"]
            if (d := _digest(m.get("digest"))) is not None:
                digests[name] = d
        for name in (self.digests.keys() | self._answered.keys()) - digests.keys():
            self._answered.pop(name, None)
        for name, d in digests.items():
            if self.digests.get(name, d) != d:
                log.info("Ollama's %s has a new digest (%s): planned as a new model", name, d[:12])
                self._answered.pop(name, None)
        self.sizes, self.digests = sizes, digests

    # -- what the engine holds -------------------------------------------------------------------
    def row_shape(self, row: dict[str, object]) -> Shape:
        """Which load a row of /api/ps is (see the module's docstring)."""
        name = canonical(str(row.get("name")))
        ctx = row.get("context_length")
        ctx = ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None
        known = self._answered.get(name)
        digest = _digest(row.get("digest"))
        default_ctx = self.default_context.get(digest) if digest is not None else None
        if known is not None:
            asked = dict(known).get("num_ctx")
            if ctx is None or asked == str(ctx):
                return known
            # a default load: the context it showed before, or any right after a default answer (the
            # default changes with Ollama's version and settings); else another load under way
            if asked is None and (default_ctx in (None, ctx) or name in self._fresh_default):
                return known
        if ctx is None:
            return ()
        if default_ctx == ctx:
            return ()
        return (("num_ctx", str(ctx)),)

    def saw_loaded(self, rows: list[dict[str, object]]) -> None:
        """`/api/ps`: a model wholly on the GPU (size_vram == size) took `size` with its context and
        runtime; one split with the CPU needs at least `size` to fit whole."""
        changed = False
        for row in rows:
            size, on_gpu = row.get("size"), row.get("size_vram")
            if not (isinstance(size, int) and isinstance(on_gpu, int) and size > 0):
                continue
            shape = self.row_shape(row)
            digest = _digest(row.get("digest"))
            ctx = row.get("context_length")
            if shape == () and digest is not None and isinstance(ctx, int) and ctx > 0 \
                    and self.default_context.get(digest) != ctx:
                self.default_context[digest] = ctx
                changed = True
            where = (digest or f"name:{canonical(str(row.get('name')))}", shape)
            old = self.footprints.get(where)
            new = Footprint(size) if on_gpu >= size else Footprint(max(size, old.bytes if old else 0), spilled=True)
            if new != old:
                self.footprints[where] = new
                changed = True
            self._fresh_default.discard(canonical(str(row.get("name"))))
        if changed:
            self._save()

    def footprint(self, model: str, shape: Shape) -> Footprint | None:
        return self.footprints.get((self.identity(canonical(model)), shape))

    # -- /api/tags ---------------------------------------------------------------------------------
    async def size_of(self, tenant: Tenant, client: httpx.AsyncClient, model: str) -> int | None:
        key = canonical(model)
        if key not in self.sizes:
            await self.refresh(tenant, client)
        return self.sizes.get(key)

    async def refresh(self, tenant: Tenant, client: httpx.AsyncClient) -> None:
        r = await client.get(f"{upstream_of(tenant)}/api/tags")
        r.raise_for_status()
        self.saw_tags(r.json().get("models") or [])

    # -- kept across restarts ----------------------------------------------------------------------
    def keep_in(self, path: Path | None) -> None:
        """Read the footprints a previous run kept at `path`, and keep them there from now on. A file
        that cannot be read or is not ours is ignored (a warning): footprints are learned again."""
        self.path = path
        if path is None or not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if data.get("version") != FILE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, not {FILE_VERSION}")
            for entry in data["footprints"]:
                shape = tuple((str(k), str(v)) for k, v in entry["shape"])
                fp = Footprint(int(entry["bytes"]), bool(entry.get("spilled", False)))
                if fp.bytes <= 0:
                    raise ValueError(f"a footprint of {fp.bytes} bytes")
                self.footprints[(str(entry["content"]), shape)] = fp
            self.default_context.update({str(d): int(c) for d, c in data.get("default_context", {}).items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring the Ollama footprints in %s (%s): they are learned again", path, exc)
            self.footprints.clear()
            self.default_context.clear()

    def _save(self) -> None:
        if self.path is None:
            return
        data = {"version": FILE_VERSION,
                "footprints": [{"content": content, "shape": [list(kv) for kv in shape], "bytes": fp.bytes,
                                "spilled": fp.spilled} for (content, shape), fp in sorted(self.footprints.items())],
                "default_context": dict(sorted(self.default_context.items()))}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("cannot keep the Ollama footprints in %s: %s", self.path, exc)
