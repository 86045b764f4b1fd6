"""Who may talk to the server: the Host, Origin and Content-Type checks and CORS, as aiohttp middleware.

A browser lets any web page send requests to ``localhost``; these checks keep such pages out:

- **Host** must name the server (DNS rebinding makes an attacker's name resolve to
  127.0.0.1, but the browser still sends that name): the bound address, the loopback names
  when bound to loopback, any IP literal or this machine's name when bound to every
  interface, and the ``--allowed-hosts`` names (``*`` turns the check off). 403 otherwise.
- **Origin**, when a browser sends one, must be the server's own origin or one of
  ``--cors-origins`` (``*``: any). Those get CORS answers: preflight ``OPTIONS`` and
  ``Access-Control-Allow-Origin`` on every response. 403 otherwise.
- **Content-Type** of an API ``POST`` must be ``application/json`` (a workspace file upload:
  ``application/x-tar`` or ``application/octet-stream``), which a page cannot send
  cross-origin without a preflight. 415 otherwise.

Refusals raise ``APIError``, so they leave as the route's error JSON.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from functools import cached_property
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from kvmem.server.errors import APIError
from kvmem_core.errors import ConfigError

API_PREFIXES = ("/v1/", "/tokenize", "/metrics", "/openapi.json")
FILE_POSTS = frozenset({"/v1/kvmem/workspaces/import"})
FILE_TYPES = ("application/x-tar", "application/octet-stream")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_CORS_HEADERS = {
    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Api-Key",
    "Access-Control-Max-Age": "600",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Security:
    """The bound address and the extra Host names and browser origins the server accepts."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for origin in self.cors_origins:
            if origin != "*" and _origin_key(origin) is None:
                raise ConfigError(f"--cors-origins {origin!r}: give scheme://host[:port], e.g. http://localhost:3000")

    @property
    def is_loopback(self) -> bool:
        """True when only this machine can connect."""
        return _is_loopback(_bare(self.bind_host))

    @property
    def is_wildcard(self) -> bool:
        """True when bound to every interface."""
        return _bare(self.bind_host) in WILDCARDS

    @cached_property
    def host_names(self) -> frozenset[str]:
        """The Host names accepted by name (IP literals aside), lowercase."""
        names = {_bare(self.bind_host).lower(), *(_bare(h).lower() for h in self.allowed_hosts)}
        if self.is_loopback or self.is_wildcard:
            names.update(LOOPBACK_NAMES)
        if self.is_wildcard:
            names.add(socket.gethostname().lower())
        return frozenset(names)

    def host_allowed(self, host_header: str) -> bool:
        """Whether a request's ``Host`` names this server (see the module docstring)."""
        if "*" in self.allowed_hosts:
            return True
        target = _split_host(host_header)
        return target is not None and (target[0] in self.host_names or (self.is_wildcard and _is_ip(target[0])))

    def cors_allowed(self, origin: str) -> bool:
        """Whether ``origin`` is one of ``--cors-origins``."""
        return "*" in self.cors_origins or _origin_key(origin) in {_origin_key(o) for o in self.cors_origins}


def same_origin(origin: str, host_header: str) -> bool:
    """Whether a browser's ``Origin`` is the origin the request was sent to (scheme's default port filled in)."""
    key = _origin_key(origin)
    if key is None:
        return False
    scheme, name, port = key
    target = _split_host(host_header)
    return target is not None and (target[0], target[1] or _DEFAULT_PORTS[scheme]) == (name, port)


def _split_host(host_header: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of a ``Host`` value such as ``[::1]:8080`` (name lowercase, brackets gone); None
    unless it is exactly host[:port]."""
    if not host_header or any(c in host_header for c in "@/?#\\ "):
        return None
    try:
        parts = urlsplit("//" + host_header)
        return (parts.hostname, parts.port) if parts.hostname else None
    except ValueError:
        return None


def _origin_key(origin: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an origin such as ``http://localhost:3000``; None if it is not one."""
    try:
        parts = urlsplit(origin.strip().rstrip("/"))
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username or parts.path or parts.query:
        return None
    return parts.scheme, parts.hostname, port or _DEFAULT_PORTS[parts.scheme]


def _bare(host: str) -> str:
    return host.strip().removeprefix("[").removesuffix("]")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(name: str) -> bool:
    return name.lower() == "localhost" or (_is_ip(name) and ipaddress.ip_address(name).is_loopback)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to print when ``host`` lets other machines in and no API key guards the API."""
    if api_key or Security(bind_host=host).is_loopback:
        return None
    return (
        f"serving on {host or '0.0.0.0'}, reachable from other machines, without --api-key: "
        "anyone who can reach this port can run the model and read every workspace's text"
    )


def security_middleware(security: Security) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The middleware that applies ``security`` before auth and routing; it answers CORS preflights itself."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is not None and not security.host_allowed(host):
            raise APIError(
                403,
                f"Host {host!r} is not this server's; start it with --allowed-hosts to accept it",
                "host_not_allowed",
            )
        origin = request.headers.get("Origin")
        cross = origin is not None and not same_origin(origin, host or "")
        if cross and not security.cors_allowed(origin):
            raise APIError(
                403,
                f"cross-origin requests from {origin!r} are refused; start the server with "
                "--cors-origins to allow them",
                "origin_not_allowed",
            )
        if cross and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers=_CORS_HEADERS)
        if (
            request.method == "POST"
            and request.path.startswith(API_PREFIXES)
            and request.content_type not in _types(request)
        ):
            raise APIError(
                415,
                f"Content-Type must be {' or '.join(_types(request))}, not {request.content_type!r}",
                "unsupported_media_type",
            )
        return await handler(request)

    return check


def _types(request: web.Request) -> tuple[str, ...]:
    """The Content-Types a POST to this path may have: JSON, or for a file upload the binary types (neither is
    one a page may send cross-origin without a preflight)."""
    return FILE_TYPES if request.path in FILE_POSTS else ("application/json",)


def cors_hook(security: Security) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """The ``on_response_prepare`` hook that lets an allowed cross-origin page read every response, errors
    included."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or same_origin(origin, request.headers.get("Host", "")) or not security.cors_allowed(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        response.headers.add("Vary", "Origin")

    return add_headers
