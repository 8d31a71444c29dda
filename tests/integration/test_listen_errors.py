"""A listener that cannot bind names the tenant, the address and the config file, with the fix for
that errno: a taken port, an address this machine does not have, a privileged port, a host that
does not resolve."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

import pytest

from proxy.engines.loading import load_registry
from proxy.errors import ConfigError
from proxy.service import Proxy, listen_error
from proxy.sim.gpu import SimulatedGpu


def config(tmp_path: Path, listen: str) -> Path:
    cfg = tmp_path / "tenants.json"
    cfg.write_text(json.dumps({"tenants": {"ollama": {"listen": listen}}}))
    return cfg


async def start(cfg: Path) -> ConfigError:
    proxy = Proxy(load_registry(cfg), SimulatedGpu(), watchdog_enabled=False, extension_factories=[], config_path=cfg)
    with pytest.raises(ConfigError) as err:
        await proxy.start(ports={"comfyui": 0, "admin": 0})  # ollama binds the configured address
    return err.value


async def test_a_taken_port_names_the_tenant_address_and_file(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        cfg = config(tmp_path, address)
        err = await start(cfg)
    finally:
        holder.close()
    text = err.one_line()
    assert "ollama" in err.message and address in err.message, text
    assert str(cfg) in text and "tenants.ollama.listen" in text, text
    assert "another program" in (err.fix or ""), text
    assert err.exit_code == 2


async def test_an_address_this_machine_lacks_says_so_not_port_taken(tmp_path: Path) -> None:
    cfg = config(tmp_path, "192.0.2.1:11435")  # TEST-NET-1: bind fails at once, nothing is sent
    err = await start(cfg)
    text = err.one_line()
    assert "192.0.2.1:11435" in err.message and "ollama" in err.message, text
    assert "another program" not in text, "the fix for a taken port, given for a missing address"
    assert "not an address of this machine" in text and str(cfg) in text, text


@pytest.mark.parametrize("exc,expected", [
    (OSError(errno.EACCES, "Permission denied"), "below 1024"),
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "does not resolve"),
    (OSError(errno.EADDRINUSE, "Address already in use"), "another program"),
    (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), "not an address of this machine"),
])
def test_each_errno_gets_its_own_fix(exc: OSError, expected: str) -> None:
    err = listen_error(exc, "comfyui", "gpu-box.lan:80", Path("/etc/hyperswap/tenants.json"))
    text = err.one_line()
    assert expected in (err.fix or ""), text
    assert "comfyui" in err.message and "gpu-box.lan:80" in err.message and "/etc/hyperswap/tenants.json" in text, text
    other = {"below 1024", "does not resolve", "another program", "not an address of this machine"} - {expected}
    assert not [o for o in other if o in text], f"another errno's fix in: {text}"


def test_the_admin_listener_and_the_shipped_defaults_are_named_too() -> None:
    err = listen_error(OSError(errno.EADDRINUSE, "Address already in use"), "admin", "127.0.0.1:11400", None)
    assert "admin.listen" in err.one_line() and "admin API" in err.message
    assert "--config" in (err.fix or ""), "with no file of one's own, the fix says where to put one"
