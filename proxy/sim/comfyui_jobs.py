"""The simulated ComfyUI's jobs API (GET /api/jobs, GET /api/jobs/{job_id}): the queue and the history
seen as one list of jobs, as ComfyUI 0.8.0 serves them (comfy_execution/jobs.py and server.py as the
API was first released, December 2025).

A job id is the prompt id. Queue items are "pending" or "in_progress", history entries "completed" or
"failed"; an interrupted prompt is "failed" too (a later release, January 2026, calls it "cancelled").
Keys whose value would be None are left out, as jobs.py prune_dict() does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]

PENDING, IN_PROGRESS, COMPLETED, FAILED = "pending", "in_progress", "completed", "failed"
STATUSES = [PENDING, IN_PROGRESS, COMPLETED, FAILED]
_PREVIEWABLE = frozenset({"images", "video", "audio"})
_3D_SUFFIXES = (".obj", ".fbx", ".gltf", ".glb")


class BadQuery(Exception):
    """A query parameter the route rejects: 400 {"error": message}."""


@dataclass(frozen=True, slots=True)
class JobQuery:
    statuses: list[str] | None
    workflow_id: str | None
    sort_by: str
    sort_order: str
    limit: int | None
    offset: int


def _first(params: dict[str, list[str]], key: str) -> str | None:
    """aiohttp's MultiDict.get(): the first value of a repeated parameter."""
    values = params.get(key)
    return values[0] if values else None


def parse_query(params: dict[str, list[str]]) -> JobQuery:
    """GET /api/jobs's parameters, checked in the route's order with its messages."""
    statuses = None
    raw_status = _first(params, "status")
    if raw_status:
        statuses = [s.strip().lower() for s in raw_status.split(",") if s.strip()]
        invalid = [s for s in statuses if s not in STATUSES]
        if invalid:
            raise BadQuery(f"Invalid status value(s): {', '.join(invalid)}. Valid values: {', '.join(STATUSES)}")
    sort_by = (_first(params, "sort_by") or "created_at").lower()
    if sort_by not in ("created_at", "execution_duration"):
        raise BadQuery("sort_by must be 'created_at' or 'execution_duration'")
    sort_order = (_first(params, "sort_order") or "desc").lower()
    if sort_order not in ("asc", "desc"):
        raise BadQuery("sort_order must be 'asc' or 'desc'")
    return JobQuery(statuses, _first(params, "workflow_id"), sort_by, sort_order, _limit(params), _offset(params))


def _limit(params: dict[str, list[str]]) -> int | None:
    if "limit" not in params:
        return None
    try:
        limit = int(params["limit"][0])
    except ValueError:
        raise BadQuery("limit must be an integer") from None
    if limit <= 0:
        raise BadQuery("limit must be a positive integer")
    return limit


def _offset(params: dict[str, list[str]]) -> int:
    if "offset" not in params:
        return 0
    try:
        return max(0, int(params["offset"][0]))  # a negative offset counts as 0
    except ValueError:
        raise BadQuery("offset must be an integer") from None


def _pruned(job: JSON) -> JSON:
    return {k: v for k, v in job.items() if v is not None}


def _metadata(extra_data: JSON) -> tuple[Any, Any]:
    """(create_time, the UI workflow's id) from a queue item's extra_data."""
    return extra_data.get("create_time"), extra_data.get("extra_pnginfo", {}).get("workflow", {}).get("id")


def queue_job(item: list[Any], status: str) -> JSON:
    """A pending or running queue item (number, prompt_id, prompt, extra_data, outputs)."""
    create_time, workflow_id = _metadata(item[3])
    return _pruned({"id": item[1], "status": status, "priority": item[0], "create_time": create_time,
                    "outputs_count": 0, "workflow_id": workflow_id})


def _previewable(media_type: str, item: JSON) -> bool:
    """What the frontend's queue can preview: images/video/audio, a video/audio format, or a 3D file."""
    fmt = item.get("format", "")
    return (media_type in _PREVIEWABLE or (bool(fmt) and fmt.startswith(("video/", "audio/")))
            or item.get("filename", "").lower().endswith(_3D_SUFFIXES))


def _outputs_summary(outputs: JSON) -> tuple[int, JSON | None]:
    """(how many output files, the one to preview: the first saved output, else the first previewable)."""
    count, preview, fallback = 0, None, None
    for node_id, node_outputs in outputs.items():
        if not isinstance(node_outputs, dict):
            continue
        for media_type, items in node_outputs.items():
            if media_type == "animated" or not isinstance(items, list):  # a flag, not files
                continue
            for item in (i for i in items if isinstance(i, dict)):
                count += 1
                if preview is None and _previewable(media_type, item):
                    enriched = {**item, "nodeId": node_id, "mediaType": media_type}
                    if item.get("type") == "output":
                        preview = enriched
                    elif fallback is None:
                        fallback = enriched
    return count, preview or fallback


def _timeline(status: JSON) -> tuple[Any, Any, Any]:
    """(start ms, end ms, the execution_error message) from a history entry's status messages."""
    start = end = error = None
    for entry in status.get("messages", []) if status else []:
        if not (isinstance(entry, (list, tuple)) and len(entry) >= 2 and isinstance(entry[1], dict)):
            continue
        event, data = entry[0], entry[1]
        if event == "execution_start":
            start = data.get("timestamp")
        elif event in ("execution_success", "execution_error", "execution_interrupted"):
            end = data.get("timestamp")
            if event == "execution_error":
                error = data
    return start, end, error


def history_job(prompt_id: str, entry: JSON, full: bool = False) -> JSON:
    """A finished prompt; `full` (GET /api/jobs/{id}) adds outputs, execution_status and the workflow."""
    _, _, prompt, extra_data, _ = entry["prompt"]
    create_time, workflow_id = _metadata(extra_data)
    status = entry.get("status", {})
    outputs = entry.get("outputs", {})
    count, preview = _outputs_summary(outputs)
    start, end, error = _timeline(status)
    job = _pruned({"id": prompt_id, "status": FAILED if status and status.get("status_str") == "error" else COMPLETED,
                   "priority": entry["prompt"][0], "create_time": create_time, "execution_start_time": start,
                   "execution_end_time": end, "execution_error": error, "outputs_count": count,
                   "preview_output": preview, "workflow_id": workflow_id})
    if full:
        job.update({"outputs": outputs, "execution_status": status,
                    "workflow": {"prompt": prompt, "extra_data": extra_data}})
    return job


def find_job(prompt_id: str, running: list[list[Any]], queued: list[list[Any]], history: dict[str, JSON]) -> JSON | None:
    """History first, then the running items, then the pending ones."""
    if prompt_id in history:
        return history_job(prompt_id, history[prompt_id], full=True)
    for items, status in ((running, IN_PROGRESS), (queued, PENDING)):
        for item in items:
            if item[1] == prompt_id:
                return queue_job(item, status)
    return None


def _sort_key(sort_by: str) -> Any:
    if sort_by == "execution_duration":
        def duration(job: JSON) -> Any:
            start, end = job.get("execution_start_time", 0), job.get("execution_end_time", 0)
            return end - start if end and start else 0
        return duration
    return lambda job: job.get("create_time", 0)


def list_jobs(query: JobQuery, running: list[list[Any]], queued: list[list[Any]],
              history: dict[str, JSON]) -> tuple[list[JSON], int]:
    """(this page of jobs, how many match): running, pending, then history, filtered, sorted, paged."""
    wanted = query.statuses if query.statuses is not None else STATUSES
    jobs = [queue_job(i, IN_PROGRESS) for i in running] if IN_PROGRESS in wanted else []
    jobs += [queue_job(i, PENDING) for i in queued] if PENDING in wanted else []
    for prompt_id, entry in history.items():
        failed = entry.get("status", {}).get("status_str") == "error"
        if (failed and FAILED in wanted) or (not failed and COMPLETED in wanted):
            jobs.append(history_job(prompt_id, entry))
    if query.workflow_id:
        jobs = [j for j in jobs if j.get("workflow_id") == query.workflow_id]
    jobs = sorted(jobs, key=_sort_key(query.sort_by), reverse=query.sort_order == "desc")
    total = len(jobs)
    jobs = jobs[query.offset:] if query.offset > 0 else jobs
    return (jobs[:query.limit] if query.limit is not None else jobs), total
