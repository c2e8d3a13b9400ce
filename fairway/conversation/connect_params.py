"""libpq's query parameters of a PostgreSQL URL (`?sslmode=require`, `?application_name=x`, ...)
as asyncpg's connect arguments: the one place every part that opens the database reads them.

SQLAlchemy's asyncpg dialect hands a URL's query to asyncpg.connect as keyword arguments, which
names them differently (ssl, server_settings, timeout) and raised TypeError at the first
connection for the libpq spelling every other tool and hosted PostgreSQL writes.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
SESSION_ATTRS = ("any", "primary", "standby", "prefer-standby", "read-write", "read-only")  # asyncpg's = libpq's
# asyncpg reads these only from a DSN's query, not as connect arguments: files (checked at start)
# and values. The CRL and the key's password go into the SSL context it builds for sslmode
# require and above (libpq ignores them below too).
DSN_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl", "passfile")
DSN_VALUES = ("sslpassword", "service")
# Left in the URL: SQLAlchemy's dialect reads them itself (a Unix socket's folder, several hosts).
_DIALECT_PARAMS = ("host", "port")
PARAMETERS = ("sslmode", *DSN_FILES, *DSN_VALUES, "application_name", "options", "connect_timeout",
              "target_session_attrs")


def engine_args(url: str, connect_args: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The async SQLAlchemy URL to open, without libpq's parameters, and asyncpg.connect's
    arguments for them, then `connect_args` (the caller's own: they win, server settings merged
    name by name). A URL that is not PostgreSQL's comes back as it is. ValueError, naming the
    parameter, for one asyncpg cannot take or a value it does not accept."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgres") or not parts.query:
        return url, dict(connect_args or {})
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(name, value) for name, value in pairs if name in _DIALECT_PARAMS]
    libpq = {name: value for name, value in pairs if name not in _DIALECT_PARAMS}  # (the last of a repeat, as libpq)
    args = _asyncpg_args(libpq)
    own = dict(connect_args or {})
    if "server_settings" in args and "server_settings" in own:
        own["server_settings"] = {**args["server_settings"], **own["server_settings"]}
    # Joined as text: urlunsplit drops the "//" of a URL without a host ("postgresql:///?service=x").
    base = url.partition("?")[0]
    return base + (f"?{urlencode(kept)}" if kept else ""), {**args, **own}


def _asyncpg_args(params: Mapping[str, str]) -> dict[str, Any]:
    unknown = [name for name in params if name not in PARAMETERS]
    if unknown:
        raise ValueError(f"the database URL's parameter {unknown[0]!r} is not supported on PostgreSQL "
                         f"(it takes {', '.join(PARAMETERS)})")
    args: dict[str, Any] = {}
    if "sslmode" in params:
        args["ssl"] = _one_of("sslmode", params["sslmode"], SSL_MODES)  # asyncpg takes libpq's mode names
    dsn = {name: _file(name, params[name]) for name in DSN_FILES if name in params}
    dsn.update({name: params[name] for name in DSN_VALUES if name in params})
    if "service" in dsn:
        _check_service(dsn["service"])
    if dsn:
        # A DSN of only these: asyncpg reads them there, and the explicit arguments (host, user,
        # database from the URL's SQLAlchemy reading) override the rest of the DSN, which is empty,
        # and a service's settings, which fill in only what the URL leaves out (as libpq's do).
        args["dsn"] = "postgresql://?" + urlencode(dsn)
    settings = {name: params[name] for name in ("application_name", "options") if name in params}
    if settings:  # startup parameters: the server applies `options` as libpq's (-c name=value ...)
        args["server_settings"] = settings
    if "connect_timeout" in params:
        args["timeout"] = _timeout(params["connect_timeout"])
    if "target_session_attrs" in params:
        args["target_session_attrs"] = _one_of("target_session_attrs", params["target_session_attrs"],
                                               SESSION_ATTRS)
    return args


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"the database URL's {name} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def _file(name: str, path: str) -> str:
    """A certificate, key, CRL or password file, checked now: a missing one was an OSError at
    the first connection, which reads as a server that is not there (a password file: a refused
    login)."""
    if not Path(path).is_file():
        raise ValueError(f"the database URL's {name} {path!r} is not a file here")
    return path


def _check_service(name: str) -> None:
    """A service asyncpg will find: it reads PGSERVICEFILE, else ~/.pg_service.conf (not libpq's
    system-wide pg_service.conf), and passes over a name it does not find there, connecting with
    the defaults instead, where libpq refuses."""
    env = os.environ.get("PGSERVICEFILE")
    path = Path(env) if env else Path.home() / ".pg_service.conf"
    services = configparser.ConfigParser()
    try:
        found = path.is_file() and bool(services.read(path)) and services.has_section(name)
    except configparser.Error as exc:
        raise ValueError(f"the database URL's service file {str(path)!r} cannot be read: "
                         f"{' '.join(str(exc).split())}") from None
    if not found:
        raise ValueError(f"the database URL's service {name!r} is not in {str(path)!r} (the service file "
                         "read is PGSERVICEFILE, else ~/.pg_service.conf; the system-wide pg_service.conf is not)")


def _timeout(value: str) -> float | None:
    """libpq's connect_timeout: whole seconds; zero or less waits indefinitely (None to asyncpg)."""
    try:
        seconds = int(value)
    except ValueError:
        raise ValueError(f"the database URL's connect_timeout must be whole seconds, not {value!r}") from None
    return float(seconds) if seconds > 0 else None


def asyncpg_connect_args(url: str) -> dict[str, Any]:
    """asyncpg.connect's arguments for a PostgreSQL URL, plain or async: where it points, read as
    the store's engine reads it (SQLAlchemy's asyncpg dialect), and its libpq parameters."""
    from sqlalchemy.dialects.postgresql.asyncpg import dialect
    from sqlalchemy.engine import make_url

    target, args = engine_args(url)
    _, where = dialect().create_connect_args(make_url(target))
    return {**where, **args}
