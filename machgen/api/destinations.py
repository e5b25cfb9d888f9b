"""Where the API may send what callers ask it to send (webhooks'
``callback_url``): public addresses only, unless the operator allows
others (``--allow-private-callbacks``).

A URL's host is resolved, and every address it resolves to must be public:
not loopback, private, link-local (cloud metadata at 169.254.169.254),
shared, reserved, multicast or unspecified. It is checked when the request
names it (a 400 naming the field) and again at each delivery, on the
address the delivery then connects to: the connection goes to that checked
address (the URL's host kept in the Host header and TLS's server name), so
a name that resolves to a public address when checked and a private one
when used (DNS rebinding) reaches nothing.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


class RefusedDestination(ValueError):
    """A URL the API will not send to; the message says why."""


def _why_not_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _why_not_public(address.ipv4_mapped)
    for test, what in ((address.is_loopback, "loopback"), (address.is_link_local, "link-local"),
                       (address.is_multicast, "multicast"), (address.is_unspecified, "unspecified"),
                       (address.is_private, "private"), (address.is_reserved, "reserved"),
                       (not address.is_global, "not public")):
        if test:
            return what
    return None


@dataclass(frozen=True)
class Destination:
    """A URL checked for sending: ``connect_url`` has the checked address in place of the host name, which
    goes in the Host header (``host_header``) and TLS's server name (``host``)."""

    url: str
    host: str
    host_header: str
    address: str
    connect_url: str


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (an address literal: itself)."""
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise RefusedDestination(f"its host {host!r} does not resolve ({err.strerror})") from None
    return list(dict.fromkeys(info[4][0] for info in found))


@dataclass(frozen=True)
class DestinationPolicy:
    # Loopback, private and link-local destinations too (a receiver on the operator's own network).
    allow_private: bool = False

    def check(self, url: str) -> Destination:
        """``url`` resolved and checked; RefusedDestination says why it is not sent to."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RefusedDestination("it must be an http:// or https:// URL with a host")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise RefusedDestination("its port is not a number in 1-65535") from None
        addresses = resolve(parts.hostname, port)
        if not self.allow_private:
            for address in addresses:
                why = _why_not_public(ipaddress.ip_address(address))
                if why is not None:
                    raise RefusedDestination(
                        f"its host {parts.hostname!r} is {address}, a {why} address; the API sends only to public "
                        f"addresses (an operator allows others with --allow-private-callbacks)")
        address = addresses[0]
        literal = f"[{address}]" if ":" in address else address
        netloc = f"{literal}:{parts.port}" if parts.port else literal
        host_header = parts.netloc.rsplit("@", 1)[-1]
        return Destination(url, parts.hostname, host_header, address,
                           urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, "")))
