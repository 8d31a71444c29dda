"""Reading the GPU processes' lineage and the listening sockets they hold from a fixture /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.gpu.proctree import ProcTreeReader, parse_listeners, read_process_tree
from proxy.gpu.snapshot import Listener
from tests.unit.proctrees import FakeProc


@pytest.fixture
def fp(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def test_listening_sockets_decode_v4_v6_and_mapped_addresses_and_skip_other_states(fp: FakeProc) -> None:
    a = fp.listen("127.0.0.1", 11434, uid=997)
    b = fp.listen("::", 8188, uid=1000)
    c = fp.listen("::ffff:127.0.0.1", 5000, uid=1000)
    fp.listen("127.0.0.1", 40000, state="01")  # an established connection, not a listener
    fp.write_net()
    got = parse_listeners((fp.root / "net" / "tcp").read_text()) + parse_listeners((fp.root / "net" / "tcp6").read_text())
    assert got == [Listener(a, "127.0.0.1", 11434, 997), Listener(b, "::", 8188, 1000),
                   Listener(c, "127.0.0.1", 5000, 1000)]


def test_kernel_format_of_a_real_line_is_understood() -> None:
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:2CAA 00000000:0000 0A 00000000:00000000 00:00000000 00000000   997        0 212705 1 "
            "000000005bcf46ca 100 0 0 10 0\n")
    assert parse_listeners(text) == [Listener(212705, "127.0.0.1", 11434, 997)]  # 0x2CAA, little-endian 127.0.0.1


def test_lineage_stops_before_init_and_records_only_held_listeners(fp: FakeProc) -> None:
    port = fp.listen("127.0.0.1", 11434)
    fp.process(700, "bash", ["bash"], ppid=1)
    fp.process(800, "ollama", ["ollama", "serve"], ppid=700, sockets=[port], other_fds=20)
    fp.process(801, "ollama", ["ollama", "runner"], ppid=800)
    fp.process(1, "systemd", ["/sbin/init"], ppid=0, sockets=[port])  # socket activation: init holds it too
    fp.write_net()
    tree = read_process_tree(fp.root, [801])
    assert [n.pid for n in tree.lineage(801)] == [801, 800, 700]
    assert 1 not in tree.nodes, "init is never read: it holds the sockets it activates for others"
    assert tree.nodes[800].sockets == frozenset({port}) and tree.nodes[801].sockets == frozenset()
    assert tree.nodes[800].name == "ollama" and tree.nodes[800].ppid == 700


def test_unreadable_fd_dir_is_recorded_not_raised(fp: FakeProc) -> None:
    port = fp.listen("127.0.0.1", 11434, uid=997)
    fp.process(800, "ollama", ["ollama", "serve"], sockets=[port])
    fp.process(801, "ollama", ["ollama", "runner"], ppid=800)
    fp.write_net()

    def denied(fd_dir: str) -> list[str]:
        raise PermissionError(13, "Permission denied", fd_dir)

    tree = read_process_tree(fp.root, [801], fd_links=denied)
    assert tree.nodes[801].sockets is None and tree.nodes[800].sockets is None
    assert tree.nodes[800].ppid == 1, "stat stays readable: the lineage is still known"


def test_vanished_processes_are_left_out(fp: FakeProc) -> None:
    fp.listen("127.0.0.1", 11434)
    fp.process(801, "worker", ["worker"], ppid=800)  # its parent 800 has exited since
    fp.write_net()
    tree = read_process_tree(fp.root, [801, 802])  # 802: gone since NVML listed it
    assert set(tree.nodes) == {801}


def test_no_listening_socket_means_no_fd_reads(fp: FakeProc) -> None:
    fp.process(801, "worker", ["worker"], ppid=800)
    fp.write_net()
    calls: list[str] = []

    def counting(fd_dir: str) -> list[str]:
        calls.append(fd_dir)
        return []

    tree = read_process_tree(fp.root, [801], fd_links=counting)
    assert tree.nodes == {} and calls == []


def test_fds_are_read_once_per_process_while_no_listener_opens_or_closes(fp: FakeProc, tmp_path: Path) -> None:
    port = fp.listen("127.0.0.1", 11434)
    fp.process(800, "llmd", ["llmd"], sockets=[port])
    fp.process(801, "worker", ["worker"], ppid=800, starttime=500)
    fp.write_net()
    reader = ProcTreeReader(fp.root)
    first = reader.read([801])
    assert reader.fd_reads == 2
    assert reader.read([801]) == first and reader.fd_reads == 2, "same processes, same listeners: no fd read"

    fp.listen("0.0.0.0", 8188)  # a server binds its port (ComfyUI after CUDA init): every holder may have changed
    fp.write_net()
    assert reader.read([801]).nodes[800].sockets == frozenset({port}) and reader.fd_reads == 4


def test_a_reused_pid_is_read_afresh(fp: FakeProc) -> None:
    port = fp.listen("127.0.0.1", 11434)
    fp.process(801, "llmd", ["llmd"], sockets=[port], starttime=500)
    fp.write_net()
    reader = ProcTreeReader(fp.root)
    assert reader.read([801]).nodes[801].sockets == frozenset({port})
    # pid 801 exits and a new process gets the pid; the listener stays listed (say another holder keeps it)
    for link in (fp.root / "801" / "fd").iterdir():
        link.unlink()
    (fp.root / "801" / "stat").write_text("801 (other) S 1 " + " ".join(["0"] * 17 + ["900"] + ["0"] * 30) + "\n")
    assert reader.read([801]).nodes[801].sockets == frozenset() and reader.fd_reads == 2


def test_without_netlink_the_listeners_come_from_proc_net(fp: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> tuple[Listener, ...]:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("proxy.gpu.proctree.read_listeners_netlink", refused)
    port = fp.listen("127.0.0.1", 11434)
    fp.process(800, "llmd", ["llmd"], sockets=[port])
    fp.write_net()
    tree = ProcTreeReader(fp.root, netlink=True).read([800])
    assert [listener.port for listener in tree.listeners] == [11434] and tree.nodes[800].sockets == frozenset({port})
