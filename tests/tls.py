"""TLS masters for the suite: a private CA with a server certificate that a strict verifier
accepts, and this machine's redis-server (Debian's is built with TLS) serving it on a TLS port.
The embedded valkey-server has no TLS."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redlock.testing import RedisServer, free_port

# What a strict verifier (Python 3.13's default context sets VERIFY_X509_STRICT) requires of a
# private CA and its server certificate; docs/operations.md ("TLS masters") says the same to users.
CA_EXTENSIONS = (
    "basicConstraints=critical,CA:TRUE",
    "keyUsage=critical,keyCertSign,cRLSign",
    "subjectKeyIdentifier=hash",
)
SERVER_EXTENSIONS = """\
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
subjectAltName=IP:127.0.0.1,DNS:localhost
"""
MISSING = (
    "needs this machine's redis-server (built with TLS) and openssl; the embedded valkey-server has no TLS"
)


def available() -> bool:
    return bool(shutil.which("redis-server") and shutil.which("openssl"))


def make_ca(folder: Path) -> None:
    """``ca.crt`` and ``ca.key`` in ``folder``: a private CA."""
    extensions = [arg for ext in CA_EXTENSIONS for arg in ("-addext", ext)]
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=celery-redlock test CA", *extensions)  # fmt: skip


def make_certificates(folder: Path) -> None:
    """A private CA (``ca.crt``, ``ca.key``) and ``server.crt``/``server.key`` it signed, for
    127.0.0.1 and localhost, in ``folder``."""
    make_ca(folder)
    _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1")  # fmt: skip
    (folder / "ext").write_text(SERVER_EXTENSIONS)
    _openssl(folder, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext")  # fmt: skip


@contextlib.contextmanager
def tls_servers(folder: Path, count: int) -> Iterator[list[tuple[RedisServer, int]]]:
    """``count`` redis-servers, each with a TLS port (and its plain one) serving the certificate
    :func:`make_certificates` writes to ``folder``: (server, TLS port) each. Skips the test where
    there is no redis-server and openssl, or one without TLS."""
    if not available():
        pytest.skip(MISSING)
    make_certificates(folder)
    servers: list[tuple[RedisServer, int]] = []
    try:
        for _ in range(count):
            port = free_port("127.0.0.1")
            server = RedisServer(
                binary=shutil.which("redis-server"),
                extra_args=["--tls-port", str(port), "--tls-cert-file", str(folder / "server.crt"),
                            "--tls-key-file", str(folder / "server.key"), "--tls-ca-cert-file",
                            str(folder / "ca.crt"), "--tls-auth-clients", "no"],
            )  # fmt: skip
            try:
                server.start()
            except Exception as exc:
                pytest.skip(f"redis-server without TLS: {exc}")
            servers.append((server, port))
        yield servers
    finally:
        for server, _ in servers:
            server.cleanup()


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)
