"""TLS for both ports: one server certificate, optional client certificates (mTLS), and the files
re-read when they change.

cert-manager and Kubernetes secrets replace certificate files in place (a secret volume swaps a
symlink), so each port's context is rebuilt when the files' identity changes, checked at most
once per `CHECK_S` as connections arrive: new connections get the new certificate, open ones
keep theirs. A rebuild that fails (a half-written file) is logged and the old context kept.
"""

from __future__ import annotations

import logging
import os
import ssl
import time

from serve.config import ServeConfig

log = logging.getLogger(__name__)

CHECK_S = 1.0
"""How often, at most, the certificate files are looked at for a change."""
ALPN = {"rest": ["http/1.1"], "grpc": ["h2"]}


class TlsError(ValueError):
    """Unusable certificate files; the message names the flag and the file."""


def _files(config: ServeConfig) -> list[tuple[str, str]]:
    files = [("--tls-cert", config.tls_cert_file), ("--tls-key", config.tls_key_file)]
    if config.tls_client_ca_file:
        files.append(("--tls-client-ca", config.tls_client_ca_file))
    return files


def build_context(config: ServeConfig, port: str) -> ssl.SSLContext:
    """A server context for `port` (rest or grpc: its ALPN protocol); TlsError naming the flag."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN[port])
    for flag, path in _files(config):
        if not os.path.isfile(path):
            raise TlsError(f"{flag} {path}: no such file")
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"--tls-cert {config.tls_cert_file} / --tls-key {config.tls_key_file}: cannot use them "
                       f"({getattr(exc, 'reason', None) or exc}): a PEM certificate (chain) and its private key") from None
    if config.tls_client_ca_file:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(f"--tls-client-ca {config.tls_client_ca_file}: not a PEM CA bundle "
                           f"({getattr(exc, 'reason', None) or exc})") from None
        context.verify_mode = ssl.CERT_REQUIRED if config.tls_client_auth == "required" else ssl.CERT_OPTIONAL
    return context


def _identity(paths: list[str]) -> tuple:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class TlsContexts:
    """A port's current server context, rebuilt when the certificate files change."""

    def __init__(self, config: ServeConfig, port: str) -> None:
        self.config, self.port = config, port
        self._paths = [path for _, path in _files(config)]
        self._identity = _identity(self._paths)
        self.context = build_context(config, port)
        self._checked = time.monotonic()
        self.reloads = 0

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked >= CHECK_S:
            self._checked = now
            identity = _identity(self._paths)
            if identity != self._identity:
                self._identity = identity
                try:
                    self.context = build_context(self.config, self.port)
                except TlsError as exc:
                    log.error("%s; keeping the certificate already in use", exc)
                else:
                    self.reloads += 1
                    log.info("%s port: certificate files changed, new connections get the new ones", self.port)
        return self.context


def tls_for(config: ServeConfig, port: str) -> TlsContexts | None:
    return TlsContexts(config, port) if config.tls_cert_file else None
