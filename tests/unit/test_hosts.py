"""The Host allow-list decision of every listener (proxy/hosts.py), without sockets.

The probe for "an address of a local interface" is injected, so nothing here depends on this
machine's addresses; the Ollama parity table is checked against the Ollama simulator's own rule.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config.schema import EngineKind, Tenant
from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
from proxy.hosts import HostPolicy, IpAddress, host_name, listener_policy
from proxy.sim.ollama_wire import host_allowed as ollama_sim_allows


def never_local(ip: IpAddress) -> bool:
    return False


def policy(listen: str | None = "127.0.0.1", allowed: tuple[str, ...] = (), **kw: Any) -> HostPolicy:
    return listener_policy(listen, allowed, probe=never_local, hostname=lambda: "GPU-Box", **kw)


LOOPBACK = ["localhost", "localhost:8189", "LOCALHOST:8189", "app.localhost", "a.b.localhost:1",
            "127.0.0.1", "127.0.0.1:11435", "127.5.6.7:80", "[::1]:8189", "[::1]", "::1", "[::ffff:127.0.0.1]:80", ""]
FOREIGN = ["attacker.example", "attacker.example:11435", "localhost.attacker.example", "localhost.", "127.0.0.1.nip.io",
           "gpu-box", "gpu.local", "db.internal", "192.168.1.5", "10.0.0.1:8189", "0.0.0.0:8189", "8.8.8.8",
           "[2001:db8::1]:80", "evil.example:80@127.0.0.1", "local host"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_every_listener_answers_loopback_names_and_addresses(host: str) -> None:
    assert policy().allows(host), f"{host!r} is loopback and must pass"


@pytest.mark.parametrize("host", FOREIGN)
def test_a_loopback_listener_refuses_other_names_by_default(host: str) -> None:
    assert not policy().allows(host), f"{host!r} is not loopback: a rebinding page could use it"


def test_host_name_drops_port_brackets_and_case() -> None:
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1]:8189") == "::1"
    assert host_name("::1") == "::1"
    assert host_name("") == ""


def test_configured_names_suffixes_and_addresses_are_allowed() -> None:
    p = policy(allowed=("llm.example.com", "*.lan", "192.168.1.5", "[fd00::7]"))
    assert p.allows("llm.example.com:11435") and p.allows("LLM.example.com")
    assert p.allows("box.lan") and p.allows("a.box.lan:80")
    assert not p.allows("lan"), "*.lan names the subdomains, not the bare suffix"
    assert p.allows("192.168.1.5:8189") and p.allows("[fd00::7]:80")
    assert not p.allows("example.com") and not p.allows("192.168.1.6")


def test_a_star_entry_turns_the_check_off() -> None:
    assert policy(allowed=("*",)).allows("attacker.example:11435")


def test_a_listener_answers_its_own_address() -> None:
    assert policy("192.168.1.5").allows("192.168.1.5:8189")
    assert policy("gpu-box.lan").allows("gpu-box.lan:8189")
    assert not policy("192.168.1.5").allows("192.168.1.6:8189")


def test_a_wildcard_listener_answers_the_machine_name_and_its_interfaces() -> None:
    local = listener_policy("0.0.0.0", (), probe=lambda ip: str(ip) == "203.0.113.7", hostname=lambda: "GPU-Box")
    assert local.allows("gpu-box:8189") and local.allows("203.0.113.7:8189")
    assert not local.allows("203.0.113.8") and not local.allows("attacker.example")


# -- Ollama: never laxer than Ollama, never stricter for a client that worked directly ------------------

# Two loopback literals Ollama refuses by accident of parsing, the drop-in allows on purpose (no DNS
# name can produce them, so they carry no rebinding risk): "[::1]" without a port (Go's SplitHostPort
# fails and the brackets stay on) and an IPv4-mapped loopback (the simulator's Python check misses it).
LOOPBACK_LITERALS = ("[::1]", "[::ffff:127.0.0.1]:80")
OLLAMA_SAMPLES = [h for h in LOOPBACK if h not in LOOPBACK_LITERALS] + FOREIGN + [
    "172.16.0.1", "172.31.255.255:80", "172.32.0.1", "169.254.1.1", "100.64.0.1", "192.0.2.1", "[fd12::1]:80",
    "[fe80::1]", "[::]:11435", "0.0.0.0", "x.local:11435", "x.internal", "x.localhost", "local", "internal",
]


@pytest.mark.parametrize("host", OLLAMA_SAMPLES)
def test_ollama_listener_allows_exactly_what_ollama_allows(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("proxy.sim.ollama_wire.socket.gethostname", lambda: "GPU-Box")
    mirrored = policy(engine_rule=True)
    assert mirrored.allows(host) == ollama_sim_allows(host), \
        f"{host!r}: the drop-in says {mirrored.allows(host)}, Ollama on loopback says {ollama_sim_allows(host)}"


def test_ollama_rule_takes_addresses_of_local_interfaces() -> None:
    p = listener_policy("127.0.0.1", (), engine_rule=True, probe=lambda ip: str(ip) == "203.0.113.7", hostname=lambda: "h")
    assert p.allows("203.0.113.7:11435") and not p.allows("203.0.113.8:11435")


def test_ollama_adapter_checks_host_on_a_loopback_listener() -> None:
    adapter = adapter_for(Tenant(name="ollama", engine="ollama", listen="127.0.0.1:11435", upstream="http://127.0.0.1:11434"))
    p = adapter.host_policy()
    assert not p.allows("attacker.example:11435")
    assert p.allows("localhost:11435") and p.allows("box.local") and p.allows("192.168.1.5")


def test_ollama_off_loopback_in_front_of_a_loopback_ollama_still_checks() -> None:
    # Ollama on 0.0.0.0 checks no Host, but the Ollama behind this drop-in (on 127.0.0.1) would.
    adapter = adapter_for(Tenant(name="ollama", engine="ollama", listen="0.0.0.0:11435", upstream="http://127.0.0.1:11434"))
    assert not adapter.host_policy().allows("attacker.example:11435")


def test_ollama_off_loopback_in_front_of_an_ollama_off_loopback_checks_nothing_like_ollama() -> None:
    adapter = adapter_for(Tenant(name="ollama", engine="ollama", listen="0.0.0.0:11435", upstream="http://10.0.0.5:11434"))
    assert adapter.host_policy().allows("anything.example:11435")
    loopback = adapter_for(Tenant(name="ollama", engine="ollama", listen="127.0.0.1:11435", upstream="http://10.0.0.5:11434"))
    assert not loopback.host_policy().allows("anything.example:11435"), "a loopback drop-in checks, as Ollama on loopback does"


@pytest.mark.parametrize("engine", ["comfyui", "generic"])
def test_comfyui_and_generic_listeners_take_only_loopback_and_configured_names(engine: EngineKind) -> None:
    # ComfyUI's own check skips a non-loopback Host, so it cannot stop rebinding: the proxy does.
    tenant = Tenant(name=engine, engine=engine, listen="127.0.0.1:8189", upstream="http://127.0.0.1:8188",
                    allowed_hosts=["studio.example.com"])
    p = adapter_for(tenant).host_policy()
    assert p.allows("127.0.0.1:8189") and p.allows("studio.example.com:8189")
    assert not p.allows("attacker.example:8189") and not p.allows("192.168.1.5:8189") and not p.allows("box.local")


def test_the_decision_cache_stays_bounded() -> None:
    p = policy()
    for i in range(1000):
        assert not p.allows(f"n{i}.example")
    assert len(p._cache) <= 256
    assert p.allows("localhost:1")


# -- configuration ---------------------------------------------------------------------------------------

def test_allowed_hosts_are_lower_cased_and_default_empty() -> None:
    reg = registry_from_dict({"tenants": {"ollama": {"allowed_hosts": ["LLM.Example.com", "*.lan"]}}})
    assert reg.get("ollama").allowed_hosts == ["llm.example.com", "*.lan"]
    assert reg.get("comfyui").allowed_hosts == [] and reg.config.admin.allowed_hosts == []


@pytest.mark.parametrize("bad", ["llm.example.com:11435", "http://llm.example.com", "a b", "*example.com", ""])
def test_allowed_hosts_entry_with_port_or_scheme_is_refused_with_its_path(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        registry_from_dict({"tenants": {"ollama": {"allowed_hosts": [bad]}}})
    assert any(p.startswith("tenants.ollama.allowed_hosts: expected a host name without port") for p in err.value.problems), \
        err.value.problems
