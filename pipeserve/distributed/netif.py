"""Which network interface gloo should use on a multi-node launch.

gloo binds to the address of this machine's hostname unless GLOO_SOCKET_IFNAME names an
interface; on hosts with several interfaces (or in a network namespace) that address may not
reach the other nodes. The interface we want is the one holding the source address the
kernel picks for --dist-init-addr (what `ip route get HOST` prints as `src`), found without
new dependencies: a UDP connect() (which sends nothing) reveals the source address, and the
interface holding it comes from SIOCGIFADDR (IPv4) or /proc/net/if_inet6 (IPv6).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

from pipeserve import envs

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
IF_INET6 = Path("/proc/net/if_inet6")


def resolve(host: str) -> str:
    """The first address of `host` (an IPv6 one may come in brackets); a host that does not
    resolve is an error: no node could reach it."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(
            f"--dist-init-addr host {host!r} does not resolve ({exc.strerror}); "
            "give node 0's IP address or a name every node can resolve"
        ) from None
    return str(infos[0][4][0])


def source_address(addr: str) -> str:
    """The local address this machine sends from to reach `addr`."""
    family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))  # UDP: picks a route and a source address, sends nothing
        return str(s.getsockname()[0])


def interface_with_address(addr: str) -> str | None:
    """The name of the local interface that holds `addr` (None if none does)."""
    ip = ipaddress.ip_address(addr)
    owners = _ipv6_addresses() if ip.version == 6 else _ipv4_addresses()
    return next((name for name, a in owners if a == ip), None)


def interface_towards(host: str) -> str | None:
    """The local interface that reaches `host`, e.g. 'lo' for 127.0.0.1."""
    return interface_with_address(source_address(resolve(host)))


def set_gloo_socket_ifname(host: str) -> str | None:
    """Point GLOO_SOCKET_IFNAME (inherited by the workers spawned next) at the interface
    that reaches `host`; left alone when already set or when `host` is a loopback address.
    Returns the name it set."""
    if envs.gloo_socket_ifname() is not None:
        return None
    addr = resolve(host)
    if ipaddress.ip_address(addr).is_loopback:
        return None
    try:
        local = source_address(addr)
    except OSError as exc:  # e.g. no route: gloo will report the failure to connect
        log.warning("no route to %s (%s); GLOO_SOCKET_IFNAME left unset", host, exc)
        return None
    name = interface_with_address(local)
    if name is None:
        log.warning(
            "no interface holds %s, the address that reaches %s (a secondary "
            "address?); set GLOO_SOCKET_IFNAME yourself",
            local,
            host,
        )
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    log.info("GLOO_SOCKET_IFNAME=%s (its address %s reaches %s)", name, local, host)
    return name


def _ipv4_addresses() -> list[tuple[str, ipaddress.IPv4Address]]:
    """(interface, primary IPv4 address) for every interface that has one."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            out.append((name, ipaddress.IPv4Address(reply[20:24])))
    return out


def _ipv6_addresses() -> list[tuple[str, ipaddress.IPv6Address]]:
    """(interface, address) for every IPv6 address; lines of /proc/net/if_inet6 read
    `<32 hex digits> <index> <prefix len> <scope> <flags> <name>`."""
    if not IF_INET6.is_file():
        return []
    out = []
    for line in IF_INET6.read_text().splitlines():
        fields = line.split()
        if len(fields) == 6:
            out.append((fields[5], ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return out
