"""The SSH transport against a real OpenSSH sshd on loopback: commands, quoting, host keys, forwards."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import free_port
from sshd import SshServer, sshd_server_fixture, write_key  # noqa: F401  (the sshd_server fixture)
from structlog.testing import capture_logs

from gputrace.config import load_config
from gputrace.errors import HostKeyError, TransportError, UsageError
from gputrace.remote.connect import connect_host, host_key_policy_from_flags
from gputrace.remote.local import LocalTransport
from gputrace.remote.ssh import HostKeyPolicy, connect_ssh

pytestmark = pytest.mark.system

HOSTILE = "a b 'c' \"d\" ; e $(touch /tmp/pwned-gputrace) `id` \\ * \n f"


async def test_run_passes_every_word_verbatim(sshd_server: SshServer, tmp_path: Path) -> None:
    """argv words with spaces, quotes, `;` and `$(...)` reach the remote command unchanged."""
    marker = tmp_path / "pwned"
    hostile = HOSTILE.replace("/tmp/pwned-gputrace", str(marker))
    transport = await connect_ssh(sshd_server.options())
    try:
        result = await transport.run(["printf", "%s\\0", hostile, "x;y"])
    finally:
        await transport.close()
    assert result.ok
    assert result.stdout.split(b"\0")[:2] == [hostile.encode(), b"x;y"]
    assert not marker.exists()


async def test_changed_host_key_is_refused(sshd_server: SshServer, tmp_path: Path) -> None:
    """A known_hosts entry with another key for the host is refused, naming the host and the fix."""
    other = write_key(tmp_path / "other")
    pub = Path(str(other) + ".pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd_server.port} {pub[0]} {pub[1]}\n")
    for policy in (HostKeyPolicy.VERIFY, HostKeyPolicy.ACCEPT_NEW):
        with pytest.raises(HostKeyError) as info:
            await connect_ssh(sshd_server.options(known_hosts=known, policy=policy))
        message = str(info.value)
        assert f"[127.0.0.1]:{sshd_server.port}" in message and "CHANGED" in message
        assert "ssh-keygen -R" in message and "\n" not in message
    assert known.read_text().count("\n") == 1  # accept-new did not add the changed key


async def test_unknown_host_key_is_refused_by_default(sshd_server: SshServer, tmp_path: Path) -> None:
    """A host missing from known_hosts is refused, and the message says how to add it."""
    known = tmp_path / "known_hosts"
    with pytest.raises(HostKeyError, match=r"not in .*known_hosts.*--accept-new-host-keys"):
        await connect_ssh(sshd_server.options(known_hosts=known))
    assert not known.exists()


async def test_accept_new_learns_an_unknown_key(sshd_server: SshServer, tmp_path: Path) -> None:
    """accept-new writes the unknown key to known_hosts (loudly); verify then accepts it."""
    known = tmp_path / "ssh" / "known_hosts"
    with capture_logs() as logs:
        transport = await connect_ssh(sshd_server.options(known_hosts=known, policy=HostKeyPolicy.ACCEPT_NEW))
        await transport.close()
    assert any(e["event"] == "ssh_host_key_learned" and e["log_level"] == "warning" for e in logs)
    assert known.read_text() == sshd_server.host_key_line()
    transport = await connect_ssh(sshd_server.options(known_hosts=known))
    try:
        assert (await transport.run(["true"])).ok
    finally:
        await transport.close()


async def test_insecure_skip_accepts_any_key_loudly(sshd_server: SshServer, tmp_path: Path) -> None:
    """insecure-skip connects despite a changed key and logs a warning saying so."""
    other = write_key(tmp_path / "other")
    pub = Path(str(other) + ".pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd_server.port} {pub[0]} {pub[1]}\n")
    with capture_logs() as logs:
        transport = await connect_ssh(
            sshd_server.options(known_hosts=known, policy=HostKeyPolicy.INSECURE_SKIP))
        await transport.close()
    assert [e["event"] for e in logs if e["log_level"] == "warning"][:1] == ["ssh_host_key_check_disabled"]


async def test_unreachable_host_is_a_transport_error(tmp_path: Path, sshd_server: SshServer) -> None:
    """A port nobody listens on gives a TransportError naming the host, not an asyncssh error."""
    opts = sshd_server.options()
    free = free_port()
    with pytest.raises(TransportError, match=f"127.0.0.1.*{free}"):
        await connect_ssh(replace(opts, port=free))


async def test_forward_reaches_a_port_on_the_remote_loopback(sshd_server: SshServer) -> None:
    """forward_local_port gives a local port that reaches a server on the host's loopback."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"agent:" + await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    agent_port = server.sockets[0].getsockname()[1]
    transport = await connect_ssh(sshd_server.options())
    try:
        local_port = await transport.forward_local_port("127.0.0.1", agent_port)
        reader, writer = await asyncio.open_connection("127.0.0.1", local_port)
        writer.write(b"hello\n")
        assert await reader.read() == b"agent:hello\n"
        writer.close()
    finally:
        await transport.close()
        server.close()
    assert await LocalTransport().forward_local_port("127.0.0.1", agent_port) == agent_port


async def test_connect_host_from_config(sshd_server: SshServer, tmp_path: Path) -> None:
    """A [[hosts]] entry with ssh, identity_file and known_hosts connects; one without runs locally."""
    toml = tmp_path / "gputrace.toml"
    toml.write_text(
        f'[[hosts]]\nname = "node0"\nssh = "root@127.0.0.1:{sshd_server.port}"\n'
        f'identity_file = "{sshd_server.client_key_path}"\nknown_hosts = "{sshd_server.known_hosts_path}"\n'
        '[[hosts]]\nname = "here"\n'
    )
    remote_host, local_host = load_config(toml).hosts
    remote = await connect_host(remote_host)
    local = await connect_host(local_host)
    try:
        assert remote.host == "node0" and local.host == "here"
        assert (await remote.run(["echo", "hi"])).stdout == b"hi\n"
        assert (await local.run(["echo", "hi"])).stdout == b"hi\n"
    finally:
        await remote.close()
        await local.close()


def test_host_key_flags_map_to_policies() -> None:
    """The two CLI flags map to the policies, and asking for both is a usage error."""
    assert host_key_policy_from_flags() is HostKeyPolicy.VERIFY
    assert host_key_policy_from_flags(accept_new_host_keys=True) is HostKeyPolicy.ACCEPT_NEW
    assert host_key_policy_from_flags(insecure_skip_host_key_check=True) is HostKeyPolicy.INSECURE_SKIP
    with pytest.raises(UsageError):
        host_key_policy_from_flags(True, True)


async def test_forward_is_restored_after_a_reconnect(sshd_server: SshServer) -> None:
    """After the sshd session is killed, the next call reconnects and the forward works on the same port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"agent:" + await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    transport = await connect_ssh(sshd_server.options())
    try:
        local_port = await transport.forward_local_port("127.0.0.1", server.sockets[0].getsockname()[1])
        assert sshd_server.kill_sessions() > 0
        for _ in range(50):  # a call made before the loss is noticed may fail once
            try:
                await transport.run(["true"])
                break
            except TransportError:
                await asyncio.sleep(0.05)
        assert transport.connects == 2
        reader, writer = await asyncio.open_connection("127.0.0.1", local_port)
        writer.write(b"again\n")
        assert await reader.read() == b"agent:again\n"
        writer.close()
    finally:
        await transport.close()
        server.close()


async def test_a_forward_recovers_on_its_own_when_the_connection_drops(sshd_server: SshServer) -> None:
    """With nothing else using the transport, a forward whose SSH connection was dropped (its sshd
    session killed) reaches the server again on the same local port: the next TCP connection
    accepted on it reconnects. (CI stop 31: sshd dropped a collector's first connection just after
    the agent's forward was made; the forward died with it and the run lost that host's agent.)"""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"agent:" + await reader.readline())
        await writer.drain()
        writer.close()

    async def ask(local_port: int, line: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", local_port)
        try:
            writer.write(line)
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    transport = await connect_ssh(sshd_server.options())
    try:
        local_port = await transport.forward_local_port("127.0.0.1", server.sockets[0].getsockname()[1])
        assert await ask(local_port, b"before\n") == b"agent:before\n"
        assert sshd_server.kill_sessions() > 0
        answers = []
        for _ in range(3):  # a channel opened before the loss is noticed may fail once
            answers.append(await ask(local_port, b"after\n"))
            if answers[-1]:
                break
            await asyncio.sleep(0.2)
        assert answers[-1] == b"agent:after\n", answers
        assert transport.connects == 2
    finally:
        await transport.close()
        server.close()


async def test_close_ends_a_forwarded_connection_still_open(sshd_server: SshServer) -> None:
    """close() ends the piping of a forwarded connection a client keeps open, and the local port."""
    held = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.set()
        await reader.read()  # until the channel closes
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    transport = await connect_ssh(sshd_server.options())
    try:
        local_port = await transport.forward_local_port("127.0.0.1", server.sockets[0].getsockname()[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", local_port)
        await asyncio.wait_for(held.wait(), 10)
        await asyncio.wait_for(transport.close(), 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", local_port)
    finally:
        await transport.close()
        server.close()
