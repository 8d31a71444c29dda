"""Release kind `http`: one HTTP call you configure (vLLM's /sleep, a UI's unload button), and
optionally a `resume` call that wakes the app before its next request is forwarded."""

from __future__ import annotations

from typing import Literal

import httpx
from pydantic import Field, model_validator

from proxy.config.fields import HttpCall, HttpMethod
from proxy.config.schema import ReleaseFailed, ReleaseSpec, Tenant
from proxy.engines.common import upstream_of


class HttpRelease(ReleaseSpec):
    """A call you configure: method, url (absolute, or a path on the upstream), JSON body."""

    kind: Literal["http"] = "http"
    method: HttpMethod = Field(default="POST", description="kind http: the HTTP method")
    url: str | None = Field(default=None, description="kind http: absolute URL, or a path on the upstream")
    body: dict[str, object] | None = Field(default=None, description="kind http: JSON body to send")
    resume: HttpCall | None = Field(default=None, description="kind http: the call that wakes the app before its next "
                                                               "request is forwarded (vLLM's /wake_up)")

    @model_validator(mode="after")
    def _needs_url(self) -> HttpRelease:
        if not self.url:
            raise ValueError("release kind 'http' needs a 'url' (absolute, or a path on the upstream)")
        return self

    @property
    def resumes(self) -> bool:
        return self.resume is not None

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        try:
            return await call_http(tenant, client, HttpCall(method=self.method, url=self.url or "", body=self.body))
        except ReleaseFailed as exc:
            raise ReleaseFailed(f"release call {exc}") from None

    async def wake(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object] | None:
        if self.resume is None:
            return None
        try:
            return await call_http(tenant, client, self.resume)
        except httpx.HTTPError as exc:
            raise ReleaseFailed(f"cannot reach {tenant.name} at {tenant.upstream} to resume it: {exc}") from exc
        except ReleaseFailed as exc:
            raise ReleaseFailed(f"resume call {exc}") from None


async def call_http(tenant: Tenant, client: httpx.AsyncClient, call: HttpCall) -> dict[str, object]:
    """One configured HTTP call: a path goes to the upstream. Raises ReleaseFailed when refused
    (>= 400); httpx errors pass through."""
    url = call.url
    if url.startswith("/"):
        url = upstream_of(tenant) + url
    r = await client.request(call.method, url, json=call.body)
    if r.status_code >= 400:
        raise ReleaseFailed(f"{call.method} {url} answered {r.status_code}")
    return {"call": f"{call.method} {url}", "status": r.status_code}
