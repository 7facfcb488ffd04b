"""The client's address behind trusted proxies (``gateway.forwarded``, pure)."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig, LimitsConfig
from gateway.forwarded import TrustedProxies, parse_networks

LB = TrustedProxies(parse_networks(["127.0.0.1", "10.0.0.0/8", "::1"]))


@pytest.mark.parametrize(("peer", "xff", "client"), [
    ("127.0.0.1", ["127.0.0.2"], "127.0.0.2"),                    # one trusted proxy
    ("127.0.0.1", [], "127.0.0.1"),                               # a trusted peer without the header
    ("127.0.0.1", ["6.6.6.6, 127.0.0.2"], "127.0.0.2"),           # the client's own header is not believed
    ("127.0.0.1", ["6.6.6.6", "127.0.0.2"], "127.0.0.2"),         # the same as two header lines
    ("127.0.0.1", ["198.51.100.7, 10.1.2.3"], "198.51.100.7"),    # two trusted hops
    ("127.0.0.1", ["10.1.2.3, 10.9.9.9"], "10.1.2.3"),            # all trusted: the leftmost seen
    ("127.0.0.2", ["6.6.6.6"], "127.0.0.2"),                      # an untrusted peer: the header is ignored
    ("::ffff:127.0.0.1", ["127.0.0.5"], "127.0.0.5"),             # v4-mapped peer
    ("::1", ["[2001:db8::1]:443"], "2001:db8::1"),
    ("127.0.0.1", ["198.51.100.7:5555"], "198.51.100.7"),
    ("127.0.0.1", ["not an address"], "127.0.0.1"),               # garbage: the proxy is what is known
])
def test_client_address(peer: str, xff: list[str], client: str) -> None:
    assert LB.client(peer, xff) == client


def test_without_trusted_proxies_the_header_is_ignored() -> None:
    assert TrustedProxies().client("127.0.0.1", ["6.6.6.6"]) == "127.0.0.1"


def test_settings_are_validated() -> None:
    GatewayConfig(trusted_proxies=("10.0.0.0/8", "127.0.0.1"))
    with pytest.raises(ValueError, match="trusted_proxies"):
        GatewayConfig(trusted_proxies=("10.0.0.0/33",))
    with pytest.raises(ValueError, match="max_sessions_per_client"):
        LimitsConfig(max_sessions_per_client=-1)
