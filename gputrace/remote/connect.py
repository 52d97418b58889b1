"""Reach a configured host: the SSH transport for ``ssh = "user@host:port"``, the local one otherwise."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gputrace.config import HostConfig
from gputrace.errors import UsageError
from gputrace.remote.local import LocalTransport
from gputrace.remote.ssh import HostKeyPolicy, SshOptions, connect_ssh
from gputrace.remote.transport import Transport

TransportFactory = Callable[[HostConfig], Awaitable[Transport]]
"""How a collector reaches each configured host (``connect_host`` unless a caller injects another)."""


def host_key_policy_from_flags(accept_new_host_keys: bool = False,
                               insecure_skip_host_key_check: bool = False) -> HostKeyPolicy:
    """The policy for ``--accept-new-host-keys`` / ``--insecure-skip-host-key-check``."""
    if accept_new_host_keys and insecure_skip_host_key_check:
        raise UsageError("--accept-new-host-keys and --insecure-skip-host-key-check exclude each other")
    if insecure_skip_host_key_check:
        return HostKeyPolicy.INSECURE_SKIP
    return HostKeyPolicy.ACCEPT_NEW if accept_new_host_keys else HostKeyPolicy.VERIFY


def ssh_options_for(host: HostConfig, host_key_policy: HostKeyPolicy = HostKeyPolicy.VERIFY) -> SshOptions:
    """SSH options from a ``[[hosts]]`` entry (which must have an ``ssh`` target)."""
    if host.ssh is None:
        raise UsageError(f"host {host.name!r} has no ssh target")
    return SshOptions(
        host=host.ssh.host, port=host.ssh.port, username=host.ssh.user,
        identity_files=(host.identity_file,) if host.identity_file else (),
        known_hosts_path=host.known_hosts, host_key_policy=host_key_policy,
    )


async def connect_host(host: HostConfig, *,
                       host_key_policy: HostKeyPolicy = HostKeyPolicy.VERIFY) -> Transport:
    """A connected transport to ``host`` (named ``host.name`` in records and messages).

    Raises HostKeyError for an unknown or changed host key, TransportError when unreachable.
    """
    if host.ssh is None:
        return LocalTransport(host.name)
    return await connect_ssh(ssh_options_for(host, host_key_policy), name=host.name)
