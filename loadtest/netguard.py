"""The load generator talks to this machine only."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class NotLocalError(ValueError):
    """The target URL is not a loopback address."""


def check_local_url(url: str) -> str:
    """Return ``url`` if it is a ws:// URL to a loopback address (``localhost`` is rewritten to
    127.0.0.1), else raise ``NotLocalError``."""
    parts = urlsplit(url)
    if parts.scheme != "ws":
        raise NotLocalError(f"{url!r}: only ws:// URLs to 127.0.0.1 are allowed")
    host = parts.hostname or ""
    if host == "localhost":  # do not trust name resolution: pin to the loopback address
        netloc = parts.netloc.replace("localhost", "127.0.0.1", 1)
        return parts._replace(netloc=netloc).geturl()
    try:
        if ipaddress.ip_address(host).is_loopback:
            return url
    except ValueError:
        pass
    raise NotLocalError(f"{url!r}: the load test only targets 127.0.0.1 (refusing host {host!r})")
