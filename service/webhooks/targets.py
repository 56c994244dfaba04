"""Which hosts webhooks may reach (SSRF): the allow-list, and no private targets unless allowed.

Called when an endpoint is registered or a `callback_url` is given (`TargetPolicy.check`, which
names the field) and, for every connection the dispatcher opens, by its sender
(`kvhandoff.service.webhooks.sender`): a name that resolved to a public address at registration may
resolve to 127.0.0.1 later (DNS rebinding), so the address actually connected to is checked too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

from kvhandoff.pipelines.errors import InvalidInput


class TargetRefused(InvalidInput):
    """A webhook URL names a host this service must not call."""

    code = "webhook_target_refused"


class TargetPolicy:
    def __init__(self, allow_hosts: list[str], allow_private: bool) -> None:
        self.allow_hosts = [h.lower() for h in allow_hosts]
        self.allow_private = allow_private

    def host_allowed(self, host: str) -> bool:
        if not self.allow_hosts:
            return True
        host = host.lower().rstrip(".")
        return any(
            host == h or (h.startswith(".") and (host.endswith(h) or host == h[1:]))
            for h in self.allow_hosts
        )

    def address_allowed(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_multicast:
            # `is_global` holds for much of 224.0.0.0/4 and ff0e::/16, but no HTTP server listens
            # on a group address: never a target, whatever allow_private says.
            return False
        return self.allow_private or ip.is_global

    def literal_refusal(self, url: str) -> str | None:
        """Why `url` may not be called, judged without DNS (the host list, an IP literal)."""
        host = urlsplit(url).hostname or ""
        if not self.host_allowed(host):
            return f"host {host!r} is not in webhooks.allow_hosts"
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return None  # a name: GuardedResolver checks what it resolves to
        return None if self.address_allowed(host) else f"{host} is a non-public address"

    async def check(self, url: str, field: str) -> None:
        """Raise TargetRefused naming `field` unless `url` is http(s) to an allowed host whose
        every address is allowed."""
        # International names travel as punycode: a non-ASCII URL (or one whose port is not a
        # number) is refused here, before the resolver can fail on it in its own way.
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            port, parts = None, None
        if (
            parts is None
            or not url.isascii()
            or parts.scheme not in ("http", "https")
            or not parts.hostname
        ):
            raise TargetRefused(
                f"{url!r} is not an ASCII http(s) URL with a host and a valid port", field=field
            )
        host = parts.hostname
        if not self.host_allowed(host):
            raise TargetRefused(f"host {host!r} is not in webhooks.allow_hosts", field=field)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port or 443, type=socket.SOCK_STREAM
            )
        except (OSError, UnicodeError) as exc:  # UnicodeError: a label IDNA cannot encode
            raise TargetRefused(f"host {host!r} does not resolve: {exc}", field=field) from None
        for info in infos:
            address = str(info[4][0])
            if not self.address_allowed(address):
                raise TargetRefused(
                    f"host {host!r} resolves to {address}, a non-public address (set "
                    "webhooks.allow_private to allow it)",
                    field=field,
                    address=address,
                )
