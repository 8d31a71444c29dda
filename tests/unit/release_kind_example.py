"""Release kind `unload_each`: unload every model an OpenAI-style server lists, one call per model."""

from __future__ import annotations

from typing import Any, Literal

import httpx
from pydantic import Field, field_validator

from proxy.config.schema import ReleaseFailed, ReleaseSpec, Tenant
from proxy.engines.common import upstream_of


class UnloadEach(ReleaseSpec):
    """GET `models_url` (OpenAI's shape: {"data": [{"id": ...}]}), then POST `unload_url` for each model."""

    kind: Literal["unload_each"] = "unload_each"
    models_url: str = Field(default="/v1/models", description="kind unload_each: the path listing the loaded models")
    unload_url: str | None = Field(default=None, validate_default=True,
                                   description="kind unload_each: the path that unloads one, with {model} in it")

    @field_validator("unload_url")
    @classmethod
    def _names_the_model(cls, value: str | None) -> str | None:
        if value is None:
            raise ValueError("release kind 'unload_each' needs 'unload_url'")
        if "{model}" not in value:
            raise ValueError(f"{value!r} does not say where the model goes: write {{model}} in it")
        return value

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, Any]:
        listed = await client.get(upstream_of(tenant) + self.models_url)
        listed.raise_for_status()
        models = [m["id"] for m in listed.json().get("data") or []]
        for model in models:
            url = upstream_of(tenant) + (self.unload_url or "").format(model=model)
            answer = await client.post(url)
            if answer.status_code >= 400:
                raise ReleaseFailed(f"POST {url} answered {answer.status_code}")
        return {"call": f"POST {self.unload_url}", "models": models}
