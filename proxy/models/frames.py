"""ComfyUI checkpoint loads, timed from the execution frames its websocket sends through the proxy.

A prompt's loader node (the one whose `ckpt_name` is the checkpoint) runs the load: from its
`executing` frame to the next `executing` frame of the same prompt is the load (the node does
nothing else). A loader listed in `execution_cached` loads nothing. Pure: frames and times in,
finished loads out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

EXPECT_FOR_S = 3600.0  # a prompt may wait in ComfyUI's queue this long before it runs


def loader_nodes(body: bytes, model: str) -> tuple[str, ...]:
    """Ids of the nodes of a /prompt body that load `model` (their inputs name it as ckpt_name)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ()
    graph = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(graph, dict):
        return ()
    return tuple(str(nid) for nid, node in graph.items()
                 if isinstance(node, dict) and (node.get("inputs") or {}).get("ckpt_name") == model)


Info = TypeVar("Info")  # what the caller needs back with a load's time (the model's files, residency before)


@dataclass(slots=True)
class _Expected(Generic[Info]):
    nodes: tuple[str, ...]
    info: Info
    since: float
    prompt_id: str | None = None
    started: float | None = None


@dataclass(slots=True)
class FrameTimer(Generic[Info]):
    now: Callable[[], float]
    expected: list[_Expected[Info]] = field(default_factory=list)

    def expect(self, nodes: tuple[str, ...], info: Info) -> None:
        if nodes:
            self.expected.append(_Expected(nodes, info, self.now()))

    def on_frame(self, text: str) -> list[tuple[Info, float]]:
        """Feed one text frame; returns (info, seconds) for each load it finished."""
        if '"executing"' not in text and '"execution_cached"' not in text:
            return []
        try:
            event = json.loads(text)
        except ValueError:
            return []
        data = event.get("data") if isinstance(event, dict) else None
        if not isinstance(data, dict):
            return []
        now = self.now()
        self.expected = [e for e in self.expected if e.started is not None or now - e.since < EXPECT_FOR_S]
        prompt = data.get("prompt_id") if isinstance(data.get("prompt_id"), str) else None
        if event.get("type") == "execution_cached":
            cached = {str(n) for n in data.get("nodes") or []}
            self.expected = [e for e in self.expected if e.started is not None or not cached & set(e.nodes)]
            return []
        if event.get("type") != "executing":
            return []
        return self._executing(data.get("node"), prompt, now)

    def _executing(self, node: object, prompt: str | None, now: float) -> list[tuple[Info, float]]:
        """A node began (None: the prompt ended): the loads of that prompt whose node is past are done,
        and an expected load whose node this is starts now."""
        done = []
        for e in list(self.expected):
            if e.started is not None and e.prompt_id == prompt and node != e.nodes[0]:
                done.append((e.info, now - e.started))
                self.expected.remove(e)
        if node is not None:
            waiting = next((e for e in self.expected if e.started is None and str(node) in e.nodes), None)
            if waiting is not None:
                waiting.started, waiting.prompt_id, waiting.nodes = now, prompt, (str(node),)
        return done
