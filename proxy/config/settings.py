"""The sections of tenants.json besides the tenants: admin, proxy, telemetry, gpu_profile."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from proxy.config.fields import StrictModel, host_list, host_port


class AdminSpec(StrictModel):
    """The admin listener: API, dashboard, /metrics, /mcp."""

    listen: str = Field(default="127.0.0.1:11400", description="host:port; off loopback it needs a bearer token")
    token_env: str = Field(default="HYPERSWAP_ADMIN_TOKEN", description="the environment variable holding the bearer "
                                                                        "token")
    token_file: str | None = Field(default=None, description="a file holding the bearer token")
    cors_origins: list[str] = Field(default_factory=list, description="web pages allowed to call the admin API "
                                                                      "cross-origin")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names the admin API answers besides loopback")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return host_port(v)

    _hosts = field_validator("allowed_hosts")(host_list)


class ProxySettings(StrictModel):
    """How the proxy plans, waits and watches."""

    watchdog_interval_s: float = Field(default=1.0, description="how often the watchdog reads the GPU and polls the "
                                                                "engines (idle release, CPU spill, stale jobs)")
    # NVML reads are sub-millisecond; 50 ms bounds the added wait
    release_poll_s: float = Field(default=0.05, description="how often the card is read while a release runs")
    queue_timeout_s: float = Field(default=300.0, description="how long a request waits for memory before a 503 with "
                                                              "Retry-After (0: answer 503 at once)")
    starvation_after_s: float = Field(default=60.0, description="how long later higher-priority arrivals may run ahead "
                                                                "of a waiter; then it goes ahead of them")
    overtake_limit: int = Field(default=8, description="requests for a model already on the card that may go ahead "
                                                       "of a request waiting to swap it away (batching: one handoff "
                                                       "for a burst); then that tenant starts nothing new until the "
                                                       "swap. starvation_after_s bounds the same wait in time")
    swap_hold_s: float = Field(default=1.0, description="the longest a swap away from a tenant active lately waits "
                                                        "after its request arrived, so that requests for what is on "
                                                        "the card sent right after go first (one swap for a burst); "
                                                        "weighed by the reload it risks (15 % of it at 2 GB/s), "
                                                        "bounded by overtake_limit. 0: off, a swap starts at once")
    swap_hold_recent_s: float = Field(default=5.0, description="with swap_hold_s: only a swap away from a tenant whose "
                                                               "work ran or ended this recently is held")
    spill_stable_s: float = Field(default=5.0, description="how long Ollama's split (size_vram < size) must hold still "
                                                           "to count as a CPU spill (a load grows)")
    job_lost_after_s: float = Field(default=120.0, description="a relayed job of an engine whose queue cannot be read "
                                                               "(down, restarting) stays busy this long after the last "
                                                               "good read, then ends with a stale_job decision")
    warm_margin_gb: float = Field(default=4.0, description="model files are read into RAM only while MemAvailable stays "
                                                           "above this many GiB (never into swap)")
    warm_during_release: bool = Field(default=True, description="read the next model's files while the other tenant "
                                                                "releases")
    keep_warm_models: int = Field(default=0, description="keep the N most recently used models' files in RAM (0: off)")


class TelemetrySettings(StrictModel):
    path: str | None = Field(
        default=None, description="SQLite file; null = ~/.local/state/hyperswap/telemetry.sqlite3, 'off' disables; "
                                  "$HYPERSWAP_TELEMETRY sets it when this is null (a path; empty or off disables)")
    retention_days: float = Field(default=30.0, description="rows older than this are deleted")
    max_rows: int = Field(default=500_000, description="the most rows kept of each kind; the oldest go first")


class LockedClocks(StrictModel):
    min: int = Field(ge=0, le=20000, description="MHz")
    max: int = Field(ge=0, le=20000, description="MHz")

    @model_validator(mode="after")
    def _ordered(self) -> LockedClocks:
        if self.min > self.max:
            raise ValueError(f"min ({self.min} MHz) must not be above max ({self.max} MHz)")
        return self


GPU_PROFILE_SETTINGS = ("power_limit_w", "locked_clocks_mhz", "gpc_clock_offset_mhz", "mem_clock_offset_mhz",
                        "fan_policy", "fan_speed_percent")


class GpuProfile(StrictModel):
    """The GPU settings the operator wants (`gpu_profile` in tenants.json). Read and compared always;
    written only with `apply: true` (and the root permission NVML needs to write)."""

    apply: bool = Field(default=False, description="write the profile to the card (needs root); off: compare only")
    device: int = Field(default=0, description="the NVML index of the GPU the profile is for (other cards are only read)")
    power_limit_w: float | None = Field(default=None, description="the power limit in watts (the card's own range is "
                                                                  "checked against NVML)")
    locked_clocks_mhz: LockedClocks | None = Field(default=None, description="graphics clock range {min, max} in MHz")
    gpc_clock_offset_mhz: int | None = Field(default=None, description="graphics clock offset in MHz")
    mem_clock_offset_mhz: int | None = Field(default=None, description="memory clock offset in MHz")
    fan_policy: Literal["auto", "manual"] | None = Field(
        default=None, description="auto (the driver's curve) or manual with fan_speed_percent (a speed outside the range "
        "NVML gives for the fans is unsupported and never written: a fan held too slow does not follow the temperature)")
    fan_speed_percent: int | None = Field(default=None, description="every fan, with fan_policy manual")
    check_interval_s: float = Field(default=30.0, description="how often the card is read and compared")

    @model_validator(mode="after")
    def _coherent(self) -> GpuProfile:
        if all(getattr(self, name) is None for name in GPU_PROFILE_SETTINGS):
            raise ValueError("sets nothing: give at least one of " + ", ".join(GPU_PROFILE_SETTINGS))
        if self.fan_speed_percent is not None and self.fan_policy != "manual":
            raise ValueError("fan_speed_percent needs fan_policy \"manual\" (the driver ignores a speed under \"auto\")")
        if self.fan_policy == "manual" and self.fan_speed_percent is None:
            raise ValueError("fan_policy \"manual\" needs fan_speed_percent (else the fans keep whatever speed they had)")
        return self
