"""The client's address behind trusted proxies: pure, no I/O.

A proxy appends the address it received a connection from to ``X-Forwarded-For``
(``a, b, c``: the client said ``a``, a first proxy saw ``b``, the last proxy saw ``c``, and the
gateway sees the last proxy itself). Only addresses written by trusted proxies can be believed:
walking the list from the right, every hop that is a trusted proxy is skipped, and the first
address that is not is the client's. Anything left of it was written by the client and may be
forged. A connection from an untrusted peer is that peer, whatever its headers say.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(items: Iterable[str]) -> tuple[Network, ...]:
    """Addresses and CIDR networks (``10.0.0.0/8``, ``::1``); ``ValueError`` names a bad one."""
    out: list[Network] = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an IP address or network: {item!r}") from None
    return tuple(out)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    t = text.strip()
    if t.startswith("[") and "]" in t:  # [v6]:port
        t = t[1:t.index("]")]
    elif t.count(":") == 1:  # v4:port
        t = t.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(t)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class TrustedProxies:
    """The proxies whose ``X-Forwarded-For`` the gateway believes (``gateway.trusted_proxies``)."""

    networks: tuple[Network, ...] = ()

    def trusted(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
        return ip is not None and any(ip in n for n in self.networks)

    def client(self, peer: str, forwarded_for: Sequence[str]) -> str:
        """The client's address for a connection from ``peer`` carrying these
        ``X-Forwarded-For`` header values (in order)."""
        ip = _ip(peer)
        if not self.trusted(ip):
            return str(ip) if ip is not None else peer
        hops = [h for v in forwarded_for for h in v.split(",") if h.strip()]
        for hop in reversed(hops):
            hip = _ip(hop)
            if hip is None:
                return str(ip)  # garbage from a trusted proxy's upstream: the proxy is what is known
            if not self.trusted(hip):
                return str(hip)
            ip = hip
        return str(ip)
