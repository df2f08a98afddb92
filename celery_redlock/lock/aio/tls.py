"""TLS for the asyncio links: the ``ssl.SSLContext`` a ``rediss://`` master's options ask for.

The threaded transports connect through redis-py's ``SSLConnection``, which builds its context
from the master's ``ssl_*`` options; asyncio takes a context instead of a socket to wrap, so this
module builds the same one from the same options: ``ssl.create_default_context()``, then the
verify mode, host name check, verify flags, client certificate, CAs, lowest version and ciphers,
in redis-py's order and with its defaults (read from the installed ``SSLConnection``'s signature:
``ssl_check_hostname`` defaults to False before redis-py 6 and to True since).

Built once, when the AsyncRedlock is built, and shared by the masters whose options are the same:
loading the system's CAs costs tens of milliseconds, which a connect made on the event loop must
not block it for (redis-py builds one per connect, on a blocking connection). So a file that
cannot be read is a ConfigError then, and renewed files are read by the next AsyncRedlock.

OCSP (``ssl_validate_ocsp*``, ``ssl_ocsp_*``) is checked by redis-py over pyOpenSSL on the
connected blocking socket; an asyncio transport has no such step, so a master that asks for it is
refused, as is any ``ssl_*`` option this module does not know (a later redis-py's), rather than
connecting with less checking than asked.
"""

from __future__ import annotations

import functools
import inspect
import ssl
from collections.abc import Sequence
from typing import Any

import redis

from ...errors import ConfigError
from ..transport.master import Master

VERIFY_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
# Honoured here (see the module docstring); every other ssl_* option must be left unset.
HONOURED = frozenset(
    {
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_min_version",
        "ssl_ciphers",
    }
)


@functools.cache
def _defaults() -> dict[str, Any]:
    """The installed redis-py's defaults for its ``SSLConnection`` options."""
    parameters = inspect.signature(redis.SSLConnection.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name.startswith("ssl_")}


def tls_options(master: Master) -> dict[str, Any] | None:
    """The master's ``ssl_*`` options, defaults filled in, ``ssl_cert_reqs`` as an
    ``ssl.VerifyMode`` and ``ssl_min_version`` as an ``ssl.TLSVersion``; None for a plain (TCP or
    unix socket) master. Raises ConfigError naming an option this transport cannot honour or a
    value it cannot use. Reads no file."""
    if not issubclass(master._connection_class, redis.SSLConnection):
        return None
    given = {name: value for name, value in master._options.items() if name.startswith("ssl_")}
    for name, value in given.items():
        if name not in HONOURED and value not in (None, False):
            raise ConfigError(
                f"masters: {master.name}: {name}={value!r} cannot be honoured by AsyncRedlock (its TLS "
                "is asyncio's: no OCSP step, and no option it does not know); leave it unset or use "
                "Redlock for this master"
            )
    defaults = _defaults()
    options = {name: given.get(name, defaults.get(name)) for name in HONOURED}
    options["ssl_cert_reqs"] = _verify_mode(master, options["ssl_cert_reqs"])
    options["ssl_min_version"] = _min_version(master, options["ssl_min_version"])
    if options["ssl_keyfile"] and not options["ssl_certfile"]:
        raise ConfigError(f"masters: {master.name}: ssl_keyfile needs ssl_certfile (the client certificate)")
    return options


def _verify_mode(master: Master, value: object) -> ssl.VerifyMode:
    """``ssl_cert_reqs`` as redis-py reads it: None, a name, or an ``ssl.VerifyMode``."""
    if value is None:
        return ssl.CERT_NONE
    if isinstance(value, str) and value in VERIFY_MODES:
        return VERIFY_MODES[value]
    if isinstance(value, ssl.VerifyMode):
        return value
    raise ConfigError(f"masters: {master.name}: ssl_cert_reqs={value!r}; expected none, optional or required")


def _min_version(master: Master, value: Any) -> ssl.TLSVersion | None:
    """``ssl_min_version``: an ``ssl.TLSVersion``, or its number (what a URL's query gives)."""
    if value is None:
        return None
    try:
        return ssl.TLSVersion(value)
    except ValueError:
        raise ConfigError(f"masters: {master.name}: ssl_min_version={value!r} is no ssl.TLSVersion") from None


def tls_contexts(masters: Sequence[Master]) -> list[ssl.SSLContext | None]:
    """Each master's context (None: plain), one per distinct :func:`tls_options` (see the module
    docstring). Raises ConfigError naming the master whose options or files cannot be used."""
    built: dict[str, ssl.SSLContext] = {}
    contexts: list[ssl.SSLContext | None] = []
    for master in masters:
        options = tls_options(master)
        if options is None:
            contexts.append(None)
            continue
        key = repr(sorted(options.items()))  # lists (the verify flags) are not hashable
        if key not in built:
            try:
                built[key] = tls_context(options)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise ConfigError(f"masters: {master.name}: cannot build its TLS context: {exc}") from None
        contexts.append(built[key])
    return contexts


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The context a master with these :func:`tls_options` wraps its links in, built as
    redis-py's ``SSLConnection`` builds its own (it reads the certificate and CA files named)."""
    context = ssl.create_default_context()
    verify_mode = options["ssl_cert_reqs"]
    # No host name to check against a certificate nobody verifies (redis-py 6's rule; set first:
    # the ssl module refuses CERT_NONE while check_hostname is on).
    context.check_hostname = bool(options.get("ssl_check_hostname")) and verify_mode != ssl.CERT_NONE
    context.verify_mode = verify_mode
    for flag in options.get("ssl_include_verify_flags") or ():
        context.verify_flags |= flag
    for flag in options.get("ssl_exclude_verify_flags") or ():
        context.verify_flags &= ~flag
    certfile = options.get("ssl_certfile")
    if certfile:  # a key file alone is refused by tls_options
        context.load_cert_chain(certfile, options.get("ssl_keyfile"), options.get("ssl_password"))
    cafile, capath, cadata = (
        options.get("ssl_ca_certs"),
        options.get("ssl_ca_path"),
        options.get("ssl_ca_data"),
    )
    if cafile is not None or capath is not None or cadata is not None:
        context.load_verify_locations(cafile=cafile, capath=capath, cadata=cadata)
    if options.get("ssl_min_version") is not None:
        context.minimum_version = options["ssl_min_version"]
    if options.get("ssl_ciphers"):
        context.set_ciphers(options["ssl_ciphers"])
    return context
