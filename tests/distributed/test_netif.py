"""Picking the interface gloo binds to from the route to --dist-init-addr."""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess

import pytest

from pipeserve.distributed import netif


def ip_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) as `ip -o -4 addr` lists them: the oracle."""
    if shutil.which("ip") is None:
        pytest.skip("needs the ip command")
    lines = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [(f[1], f[3].split("/")[0]) for f in (line.split() for line in lines)]


@pytest.fixture
def unset_ifname(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GLOO_SOCKET_IFNAME during the test, and none left behind by what it sets."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # remembers the value to restore
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")


def test_loopback_is_reached_through_lo() -> None:
    assert netif.interface_towards("127.0.0.1") == "lo"


def test_an_address_of_this_machine_is_reached_through_its_interface() -> None:
    others = [(n, a) for n, a in ip_addresses() if not ipaddress.ip_address(a).is_loopback]
    if not others:
        pytest.skip("no non-loopback IPv4 address here")
    for name, addr in others:
        assert netif.interface_towards(addr) == name


def test_sets_the_variable_for_a_non_loopback_address(unset_ifname) -> None:
    others = [(n, a) for n, a in ip_addresses() if not ipaddress.ip_address(a).is_loopback]
    if not others:
        pytest.skip("no non-loopback IPv4 address here")
    name, addr = others[0]
    assert netif.set_gloo_socket_ifname(addr) == name
    assert netif.envs.gloo_socket_ifname() == name


def test_loopback_or_a_set_variable_is_left_alone(unset_ifname, monkeypatch) -> None:
    assert netif.set_gloo_socket_ifname("127.0.0.1") is None
    assert netif.envs.gloo_socket_ifname() is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    assert netif.set_gloo_socket_ifname("192.0.2.1") is None
    assert netif.envs.gloo_socket_ifname() == "mine0"


def test_an_unresolvable_host_is_a_clear_error(unset_ifname, monkeypatch) -> None:
    def no_such_host(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    with pytest.raises(ValueError, match="host 'node0.invalid' does not resolve"):
        netif.set_gloo_socket_ifname("node0.invalid")


def test_an_address_no_interface_holds_maps_to_none() -> None:
    addr = "203.0.113.77"  # TEST-NET-3: documentation only
    if addr in {a for _, a in ip_addresses()}:
        pytest.skip(f"{addr} is configured here")
    assert netif.interface_with_address(addr) is None


def test_ipv6_loopback_in_brackets_is_reached_through_lo() -> None:
    if "::1" not in {str(a) for _, a in netif._ipv6_addresses()}:
        pytest.skip("no IPv6 loopback here")
    assert netif.interface_towards("[::1]") == "lo"
