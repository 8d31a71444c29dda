"""ComfyUI: POST /prompt queues GPU work that outlives the HTTP response.

A prompt is busy from the POST /prompt answer ({"prompt_id": P, ...}) until the websocket frame
{"type":"executing","data":{"node":null,"prompt_id":P}} or until /history/P lists it.
Host/Origin: the base same-origin rewrite (see EngineAdapter.rewrite_origin) matches ComfyUI's
origin_only_middleware, which 403s when a loopback Host differs from the Origin's host:port.
"""

from __future__ import annotations

import json

from proxy.engines.base import EngineAdapter, RequestKind

PROMPT_ROUTES = frozenset({"/prompt", "/api/prompt"})
QUEUE_ROUTES = frozenset({"/queue", "/api/queue"})  # POST {"delete": [...]} / {"clear": true}


class ComfyUIAdapter(EngineAdapter):
    kind = "comfyui"
    device_flag = "--cuda-device"  # main.py sets CUDA_VISIBLE_DEVICES from it before torch starts
    model_layout = "comfyui"

    def classify(self, method: str, path: str) -> RequestKind:
        if method.upper() == "POST" and path.rstrip("/") in PROMPT_ROUTES:
            return "gpu"
        return "passthrough"

    def captures_job(self, method: str, path: str) -> bool:
        return self.classify(method, path) == "gpu"

    def job_id_from_response(self, status: int, body: bytes) -> str | None:
        data = _ok_json(status, body)
        pid = data.get("prompt_id") if isinstance(data, dict) else None
        return pid if isinstance(pid, str) and pid else None

    def job_done_from_frame(self, text: str) -> str | None:
        if "executing" not in text:  # cheap filter: most frames are progress/status
            return None
        try:
            msg = json.loads(text)
        except ValueError:
            return None
        if not isinstance(msg, dict) or msg.get("type") != "executing":
            return None
        data = msg.get("data")
        if isinstance(data, dict) and "node" in data and data["node"] is None:
            pid = data.get("prompt_id")
            return pid if isinstance(pid, str) else None
        return None

    def history_path(self, job_id: str) -> str | None:
        return f"/history/{job_id}"

    def job_done_from_history(self, job_id: str, status: int, body: bytes) -> bool:
        # /history/{id} is {} until the prompt finished (success, error or interrupt).
        if status != 200:
            return False
        try:
            data = json.loads(body)
        except ValueError:
            return False
        return isinstance(data, dict) and job_id in data

    def queue_path(self) -> str | None:
        return "/queue"

    def job_ids_from_queue(self, status: int, body: bytes) -> frozenset[str] | None:
        # {"queue_running": [[number, prompt_id, graph, extra, outputs], ...], "queue_pending": [...]}
        data = _ok_json(status, body)
        if not isinstance(data, dict):
            return None
        ids = set()
        for section in ("queue_running", "queue_pending"):
            rows = data.get(section)
            if not isinstance(rows, list):
                return None
            ids.update(row[1] for row in rows if isinstance(row, list) and len(row) > 1 and isinstance(row[1], str))
        return frozenset(ids)

    def drops_jobs(self, method: str, path: str) -> bool:
        return method.upper() == "POST" and path.rstrip("/") in QUEUE_ROUTES


def _ok_json(status: int, body: bytes) -> object:
    """The JSON of a 200 answer; None for any other status or a body that is not JSON."""
    if status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None
