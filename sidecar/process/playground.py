"""The playground page the admin port serves at ``/``: type a prompt, watch it stream.

A static page (``static/playground.html``) that calls the proxy port from the
browser, under the proxy's own rules (CORS, auth); the admin server only
fills in where the proxy port is.
"""

from __future__ import annotations

import html
import importlib.resources
import urllib.parse
from dataclasses import dataclass

from ..settings import SidecarConfig

_PROXY_URL_PLACEHOLDER = "{{PROXY_URL}}"
# Bound to every interface: the browser must use the name it reached the admin port by.
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


@dataclass(frozen=True, slots=True)
class Playground:
    """The playground page, told where the proxy port is."""

    template: str
    proxy_scheme: str
    proxy_host: str
    proxy_port: int

    @classmethod
    def load(cls, config: SidecarConfig, proxy_address: tuple[str, int] | None) -> Playground:
        """Read the page from the package; ``proxy_address`` is the proxy's bound (host, port)."""
        if proxy_address is None:
            # Without the bound address the configured one is the best guess (wrong for port 0).
            host, _, port = config.listen.rpartition(":")
            proxy_address = (host.strip("[]"), int(port))
        template = (importlib.resources.files("tokenwire.sidecar.process")
                    .joinpath("static/playground.html").read_text("utf-8"))
        return cls(template, "https" if config.tls else "http", *proxy_address)

    def proxy_url(self, admin_host_header: bytes | None) -> str:
        """The proxy's base URL as a browser that sent ``admin_host_header`` can reach it."""
        host = self.proxy_host
        if host in _WILDCARD_HOSTS and admin_host_header:
            parsed = urllib.parse.urlsplit("//" + admin_host_header.decode("ascii", "replace"))
            host = parsed.hostname or "127.0.0.1"
        elif host in _WILDCARD_HOSTS:
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"{self.proxy_scheme}://{host}:{self.proxy_port}"

    def render(self, admin_host_header: bytes | None) -> bytes:
        """The page with the proxy's URL filled in."""
        url = html.escape(self.proxy_url(admin_host_header), quote=True)
        return self.template.replace(_PROXY_URL_PLACEHOLDER, url).encode("utf-8")
