"""Optional mutual TLS and bearer-token authentication, for both services and between
servers.

* :class:`Security` names the files: a CA bundle (to verify the other end), this
  end's certificate and key, and a bearer token (read from a file or from the
  ``GRAPHFEED_TOKEN`` environment variable, never from the command line).
* Clients: :func:`protos.channel.create_channel` makes a TLS channel when a CA is
  configured (presenting the certificate and key when given, for mutual TLS) and adds
  ``authorization: Bearer <token>`` to every call when a token is configured. Without an
  explicit ``security=``, it uses :func:`default_security`, which a CLI sets with
  :func:`set_default_security` or which comes from the environment
  (``GRAPHFEED_TLS_CA``, ``GRAPHFEED_TLS_CERT``, ``GRAPHFEED_TLS_KEY``,
  ``GRAPHFEED_TOKEN`` / ``GRAPHFEED_TOKEN_FILE``).
* Servers: :func:`server_credentials` (client certificates required when a client CA
  is given) and :class:`TokenInterceptor`, which answers every call without the right
  token ``UNAUTHENTICATED`` and nothing else (the health service stays open, so
  orchestrators can probe it; it tells only whether the server is ready).
* Secure by default: :func:`require_credentials` refuses a server that would listen
  beyond loopback with neither TLS nor a token, unless it was told ``insecure``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

#: Environment variable holding the bearer token.
TOKEN_ENV = "GRAPHFEED_TOKEN"
#: Environment variable naming a file that holds the bearer token.
TOKEN_FILE_ENV = "GRAPHFEED_TOKEN_FILE"
#: Methods open without a token (prefix match).
OPEN_METHODS = ("/grpc.health.v1.Health/",)


class SecurityError(ValueError):
    """A TLS or token setting is unusable; names the setting and the file."""


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{what}: cannot read {path} ({exc.strerror})") from exc


#: Random bytes of a token made by :func:`make_token_file` (256 bits).
TOKEN_BYTES = 32


def make_token_file(path: str | Path) -> bool:
    """Write a new random bearer token to ``path`` (mode 600, its directory made) unless
    the file exists; whether one was written. One token per cluster: every server and
    trainer of the cluster reads this file (never a command-line value)."""
    target = Path(path)
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
    try:  # another maker may have won meanwhile: keep its token, drop this one
        os.link(partial, target)
    except FileExistsError:
        return False
    finally:
        partial.unlink()
    return True


def read_token(token_file: Path | None = None) -> str | None:
    """The bearer token: from ``token_file``, else ``$GRAPHFEED_TOKEN_FILE``, else
    ``$GRAPHFEED_TOKEN``; None when none is set. Surrounding whitespace is dropped."""
    path = token_file or (Path(os.environ[TOKEN_FILE_ENV]) if os.environ.get(TOKEN_FILE_ENV)
                          else None)
    if path is not None:
        raw = _read(path, "token file")
        token = (raw or b"").decode("utf-8", "replace").strip()
        if not token:
            raise SecurityError(f"token file: {path} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


@dataclass(frozen=True)
class Security:
    """TLS files and bearer token of one end (all optional)."""

    #: CA bundle (PEM): a client verifies servers with it; a server requires client
    #: certificates signed by it (mutual TLS).
    ca: Path | None = None
    #: This end's certificate chain (PEM).
    cert: Path | None = None
    #: This end's private key (PEM).
    key: Path | None = None
    #: Bearer token sent with (client) or required of (server) every call.
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise SecurityError(f"tls cert/key: expected both or neither, got cert={self.cert} "
                                f"key={self.key}")
        if self.token is not None and not self.token.isprintable():
            raise SecurityError("token: expected printable characters")

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def __repr__(self) -> str:  # never show the token
        return (f"Security(ca={self.ca}, cert={self.cert}, key={self.key}, "
                f"token={'set' if self.token else None})")

    # -- client side -------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials of a client (the CA, plus cert and key for mutual TLS)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "tls ca"), private_key=_read(self.key, "tls key"),
            certificate_chain=_read(self.cert, "tls cert"))

    # -- server side -------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS credentials of a server; client certificates are required when a CA is
        given."""
        if self.cert is None or self.key is None:
            raise SecurityError("tls: a server needs --tls-cert and --tls-key")
        key, cert = _read(self.key, "tls key"), _read(self.cert, "tls cert")
        assert key is not None and cert is not None
        ca = _read(self.ca, "tls client ca")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def interceptors(
        self, on_deny: Callable[[str, str], None] | None = None
    ) -> list[grpc.ServerInterceptor]:
        """The server interceptors (the token check when a token is set); ``on_deny``
        is called with the method and ``"UNAUTHENTICATED"`` for every refused call."""
        return [TokenInterceptor(self.token, on_deny)] if self.token else []


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) names this
    machine's loopback interface only: every address it resolves to is a loopback one.
    The wildcard (``0.0.0.0``, ``::``, empty) and names that do not resolve are not."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def require_credentials(listen: str, security: Security, insecure: bool) -> None:
    """Raise :class:`SecurityError` when a server would listen on ``listen`` (host:port)
    beyond loopback with neither TLS nor a bearer token and was not told ``insecure``:
    anyone reaching the port could read every node's features, labels and edges."""
    host = listen.rsplit(":", 1)[0]
    if security.tls or security.token or insecure or is_loopback(host):
        return
    raise SecurityError(
        f"listen: {listen} is reachable from other machines, and the server has neither TLS nor "
        "a token: anyone who reaches the port could read every node's features, labels and "
        "edges. Expected credentials: --tls-cert and --tls-key (with --tls-ca for mutual TLS), "
        "or --token-file FILE (or GRAPHFEED_TOKEN_FILE), FILE made once per cluster by "
        "`python -m protos.security new-token FILE`; or listen on 127.0.0.1; or pass "
        "--insecure (cluster.yaml: insecure: true) to serve a network you trust without them")


_lock = threading.Lock()
_default: Security | None = None


def set_default_security(security: Security | None) -> Security | None:
    """Sets the security every channel made without ``security=`` uses (None: from the
    environment) and returns the one set before, for the caller to restore."""
    global _default
    with _lock:
        previous, _default = _default, security
    return previous


def default_security() -> Security:
    """What :func:`set_default_security` set, else what the environment says."""
    with _lock:
        if _default is not None:
            return _default

    def path(name: str) -> Path | None:
        value = os.environ.get(name)
        return Path(value) if value else None
    return Security(ca=path("GRAPHFEED_TLS_CA"), cert=path("GRAPHFEED_TLS_CERT"),
                    key=path("GRAPHFEED_TLS_KEY"), token=read_token())


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _ClientCallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation: Callable[..., Any],
                              client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    # the same for every kind of call: grpc passes the request (or iterator) positionally
    intercept_unary_stream = intercept_unary_unary
    intercept_stream_unary = intercept_unary_unary
    intercept_stream_stream = intercept_unary_unary


class TokenInterceptor(grpc.ServerInterceptor):
    """Answers ``UNAUTHENTICATED`` to every call (but health checks) that lacks
    ``authorization: Bearer <token>``; the method is never run."""

    def __init__(self, token: str, on_deny: Callable[[str, str], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_deny = on_deny

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong bearer token (authorization metadata)")
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method or ""
        if method.startswith(OPEN_METHODS):
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        raw = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(raw, self._expected):
            return continuation(handler_call_details)
        if self._on_deny is not None:
            self._on_deny(method.rsplit("/", 1)[-1], "UNAUTHENTICATED")
        handler = continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_bidi
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


__all__ = [
    "Security",
    "SecurityError",
    "TokenClientInterceptor",
    "TokenInterceptor",
    "default_security",
    "is_loopback",
    "make_token_file",
    "read_token",
    "require_credentials",
    "set_default_security",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m protos.security new-token FILE``: make the cluster's token file (mode
    600) unless it exists; says which, never the token."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "new-token":
        sys.stderr.write("usage: python -m protos.security new-token FILE\n")
        return 2
    try:
        made = make_token_file(args[1])
    except OSError as exc:
        sys.stderr.write(f"new-token: cannot write {args[1]} ({exc.strerror})\n")
        return 1
    sys.stdout.write(f"{'made a new token in' if made else 'kept the token in'} {args[1]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
