"""What a client presents beyond its requests: the CA bundle it trusts, its own certificate (mTLS)
and a bearer token; one value shared by every transport."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Security:
    """TLS and token options of a `SentimentClient`.

    ca_file: PEM bundle of the CAs to trust (default: the system's); implies TLS on gRPC.
    cert_file, key_file: the client's PEM certificate (chain) and private key, for servers that
        ask for one (mutual TLS); implies TLS on gRPC.
    token: sent as `Authorization: Bearer TOKEN` (gRPC: `authorization` metadata).
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r}: no such file")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: the client certificate and its private key")
        if self.token is not None and (not self.token.strip() or any(c in self.token for c in "\r\n")):
            raise ValueError("token: expected one non-empty line")

    @property
    def tls_files_given(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    @property
    def authorization(self) -> str | None:
        return None if self.token is None else f"Bearer {self.token.strip()}"

    def read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()


NO_SECURITY = Security()
