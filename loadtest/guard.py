"""The loopback guard: the load tester only ever talks to servers on this machine.

A load test is a denial-of-service tool by design, so base URLs are restricted
to loopback. Only literal loopback IPs and the name ``localhost`` are accepted;
other host names are refused rather than resolved, because a name that
resolves to loopback now may resolve elsewhere when the request is sent.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class NonLoopbackURLError(ValueError):
    """The base URL does not point at a loopback address."""


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1`` and IPv4-mapped loopback."""
    h = host.strip().rstrip(".").lower()
    if h == "localhost":
        return True
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    try:
        addr = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def check_loopback_url(url: str) -> str:
    """Return ``url`` without a trailing slash, or raise NonLoopbackURLError.

    The URL must be ``http`` or ``https`` with a loopback host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise NonLoopbackURLError(f"--base-url must be http(s)://, got {url!r}")
    host = parts.hostname
    if not host or not is_loopback_host(host):
        raise NonLoopbackURLError(
            f"refusing to load-test {url!r}: the host must be loopback "
            "(127.0.0.0/8, ::1 or localhost)"
        )
    try:
        _ = parts.port  # raises on a malformed port
    except ValueError as e:
        raise NonLoopbackURLError(f"bad port in --base-url {url!r}: {e}") from e
    return url.rstrip("/")
