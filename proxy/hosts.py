"""Which `Host` a listener answers: the DNS-rebinding check in front of every engine and the admin API.

A rebinding page is served as `attacker.example:11435`, then its name is pointed at 127.0.0.1; the
browser treats the proxy as that page's own origin and sends `Host: attacker.example:11435`. The Host
name is the only thing that tells such a request from a real local client, and the proxy always sends
the engine its own loopback Host, so the engine can no longer tell: the proxy must check it first.

Pure decisions (no sockets opened here but the local-address probe, which is injectable): a listener
allows loopback names and addresses, its own address, and what tenants.json adds; Ollama's listeners
also allow what Ollama itself allows (engine-wire-facts A.1), so the drop-in is never laxer than the
engine and never stricter than it for a client that worked directly (two loopback literals Ollama
refuses by a parsing accident aside: "[::1]" without a port and ::ffff:127.0.0.1; tests/unit/test_hosts.py).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from proxy.memo import remember

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK_NETS: tuple[IpNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# Go's netip IsPrivate (RFC 1918, RFC 4193) and IsUnspecified, which Ollama allows. Not Python's
# is_private: it also takes link-local, documentation and reserved ranges, which Ollama refuses.
OLLAMA_EXTRA_NETS: tuple[IpNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7", "0.0.0.0/32", "::/128"))
OLLAMA_SUFFIXES = (".local", ".internal")
WILDCARD_LISTEN = frozenset({"", "0.0.0.0", "::"})
CACHE_MAX = 256  # distinct Host values remembered per listener; a flood of new ones only misses


def is_local_address(ip: IpAddress) -> bool:
    """Whether `ip` is assigned to an interface of this machine (Ollama's isLocalIP).

    Binding a socket to an address succeeds only for a local one: portable, and no interface list
    to keep fresh when DHCP or a VPN changes the addresses."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((str(ip), 0))
    except OSError:
        return False
    return True


def host_name(host_header: str) -> str:
    """The lower-case name or address in a Host header: no port, no IPv6 brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host  # a name, or a bare IPv6 address (Go's SplitHostPort fails and Ollama parses it whole)


def parse_ip(name: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1 (Go's netip unmaps too)
    return ip


def is_loopback_host(name: str) -> bool:
    """A loopback name or address: localhost, *.localhost (RFC 6761), 127.0.0.0/8, ::1."""
    name = host_name(name)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    ip = parse_ip(name)
    return ip is not None and ip.is_loopback


def _entry(pattern: str) -> tuple[str | None, str | None, IpAddress | None]:
    """A configured allowed_hosts entry as (exact name, suffix, address)."""
    name = host_name(pattern) if pattern.startswith("[") else pattern.strip().lower()
    if name.startswith("*."):
        return None, name[1:], None
    ip = parse_ip(name)
    return (None, None, ip) if ip is not None else (name, None, None)


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """The Host names one listener answers. `allows()` decides on the raw header value."""

    names: frozenset[str] = frozenset({"localhost"})
    suffixes: tuple[str, ...] = (".localhost",)
    addresses: frozenset[IpAddress] = frozenset()
    networks: tuple[IpNetwork, ...] = LOOPBACK_NETS
    local_addresses: bool = False  # any address of a local interface (Ollama's rule; wildcard listeners)
    anything: bool = False  # no check at all (configured "*", or Ollama's own behaviour off loopback)
    probe: Callable[[IpAddress], bool] = field(default=is_local_address, compare=False, repr=False)
    _cache: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    def allows(self, host_header: str) -> bool:
        if self.anything:
            return True
        known = self._cache.get(host_header)
        if known is None:
            known = remember(self._cache, host_header, self._decide(host_name(host_header)), CACHE_MAX)
        return known

    def _decide(self, name: str) -> bool:
        if name == "":  # no Host at all (HTTP/1.0): never a browser, and Ollama allows it too
            return True
        ip = parse_ip(name)
        if ip is None:
            return name in self.names or name.endswith(self.suffixes)
        if ip in self.addresses or any(ip in net for net in self.networks if net.version == ip.version):
            return True
        return self.local_addresses and self.probe(ip)


def _allowed(allowed: Iterable[str]) -> tuple[set[str], list[str], set[IpAddress]]:
    """tenants.json's `allowed_hosts` as (names, `.suffix`es, addresses), loopback's names included."""
    entries = [_entry(p) for p in allowed]
    names = {"localhost"} | {n for n, _, _ in entries if n}
    suffixes = [".localhost"] + [s for _, s, _ in entries if s]
    addresses = {ip for _, _, ip in entries if ip is not None}
    return names, suffixes, addresses


def listener_policy(listen_host: str | None, allowed: Iterable[str] = (), *, engine_rule: bool = False,
                    engine_checks: bool = True,
                    probe: Callable[[IpAddress], bool] = is_local_address,
                    hostname: Callable[[], str] = socket.gethostname) -> HostPolicy:
    """The policy of a listener on `listen_host` (None: a loopback test listener).

    Every listener allows loopback names and addresses, its own address, and `allowed` (tenants.json:
    names, `*.suffix`, addresses, or `*` for no check). A wildcard listener (0.0.0.0, ::) also allows
    this machine's name and the addresses of its interfaces: they are its own addresses.
    `engine_rule` adds what Ollama allows on a loopback listener. `engine_checks` False says the engine
    behind checks no Host either (Ollama off loopback): then a non-loopback listener checks none,
    as Ollama does on 0.0.0.0; a loopback one still checks, as Ollama does on 127.0.0.1.
    """
    listen = (listen_host or "127.0.0.1").strip("[]").lower()
    loopback_listener = is_loopback_host(listen)
    if "*" in (p.strip() for p in allowed) or (not engine_checks and not loopback_listener):
        return HostPolicy(anything=True, probe=probe)
    names, suffixes, addresses = _allowed(allowed)
    networks = list(LOOPBACK_NETS)
    wildcard = listen in WILDCARD_LISTEN
    own = parse_ip(listen)
    if own is not None:
        addresses.add(own)
    elif not wildcard:
        names.add(listen)
    if wildcard or engine_rule:
        names.add(hostname().lower())
    if engine_rule:
        suffixes += OLLAMA_SUFFIXES
        networks += OLLAMA_EXTRA_NETS
    return HostPolicy(names=frozenset(names), suffixes=tuple(suffixes), addresses=frozenset(addresses),
                      networks=tuple(networks), local_addresses=wildcard or engine_rule, probe=probe)
