"""Optional bearer tokens: who may call inference and metadata, and who may manage models.

A token file holds one token per line (blank lines and `#` comments skipped), so a secret can be
rotated by adding the new token before removing the old one; the file is re-read when it changes
(looked at once a second at most, as requests arrive). A request presents `Authorization: Bearer
TOKEN` (REST) or the same `authorization` metadata (gRPC); the token is compared with every
accepted one in constant time (as SHA-256 digests, so that not even its length shows in the timing),
and a refusal never says which part was wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

from serve.core.errors import Code, ServingError

log = logging.getLogger(__name__)

CHECK_S = 1.0
"""How often, at most, a token file is looked at for a change."""


class Unauthenticated(ServingError):
    """No valid bearer token for an operation that needs one."""

    code = Code.UNAUTHENTICATED


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the flag and the file."""


def read_tokens(flag: str, path: str) -> tuple[bytes, ...]:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise TokenFileError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    tokens = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith(b"#"))
    if not tokens:
        raise TokenFileError(f"{flag} {path}: holds no token (one per line)")
    if any(len(t) < 16 or any(c <= 0x20 or c >= 0x7F for c in t) for t in tokens):
        raise TokenFileError(f"{flag} {path}: every token must be at least 16 printable ASCII characters without spaces")
    return tokens


class TokenFile:
    """The tokens of one file, re-read when the file changes (a file that became unusable is
    logged and the tokens already read are kept)."""

    def __init__(self, flag: str, path: str) -> None:
        self.flag, self.path = flag, path
        self.tokens = read_tokens(flag, path)
        self._digests = _digests(self.tokens)
        self._identity = self._stat()
        self._checked = time.monotonic()

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def current(self) -> tuple[bytes, ...]:
        """The SHA-256 digests of the tokens accepted now (the file looked at once a second at most)."""
        now = time.monotonic()
        if now - self._checked >= CHECK_S:
            self._checked = now
            identity = self._stat()
            if identity != self._identity:
                self._identity = identity
                try:
                    self.tokens = read_tokens(self.flag, self.path)
                    self._digests = _digests(self.tokens)
                    log.info("%s changed: %d token(s) accepted from now on", self.flag, len(self.tokens))
                except TokenFileError as exc:
                    log.error("%s; keeping the tokens already read", exc)
        return self._digests

    def accepts(self, authorization: bytes | str | None) -> bool:
        """Whether `authorization` (the header's value) is `Bearer` and one of the tokens."""
        if not authorization:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        scheme, _, token = authorization.strip().partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        found = False
        for accepted in self.current():  # every one compared, in constant time: no early exit
            found |= hmac.compare_digest(digest, accepted)
        return found and scheme.lower() == b"bearer"


def _digests(tokens: tuple[bytes, ...]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(t).digest() for t in tokens)


class Authorizer:
    """What a request needs: `api` (inference, metadata, metrics unless open) or `admin` (model
    management: the admin tokens; without an admin file, which the config allows only while model
    management is off, the API tokens). Probes (health, readiness) need nothing and are not asked."""

    def __init__(self, api: TokenFile | None, admin: TokenFile | None, metrics_open: bool) -> None:
        self.api, self.admin, self.metrics_open = api, admin, metrics_open

    @property
    def enabled(self) -> bool:
        return self.api is not None

    def check(self, authorization: bytes | str | None, scope: str = "api") -> None:
        """Unauthenticated unless `authorization` carries a token of `scope`'s file."""
        tokens = self.admin if scope == "admin" and self.admin is not None else self.api
        if tokens is not None and not tokens.accepts(authorization):
            raise Unauthenticated("a valid bearer token is required (Authorization: Bearer TOKEN)")


def authorizer_for(config) -> Authorizer:  # noqa: ANN001 - a serve.config.ServeConfig
    """The server's Authorizer (a disabled one without --auth-token-file); TokenFileError if a file is unusable."""
    api = TokenFile("--auth-token-file", config.auth_token_file) if config.auth_token_file else None
    admin = TokenFile("--admin-token-file", config.admin_token_file) if config.admin_token_file else None
    return Authorizer(api, admin, config.metrics_open)
