"""How statecache reads a Redis URL (`REDIS_URL`, or a URL given to `producer.Client.connect`): one reading for the
worker, the Client, `arq worker.WorkerSettings --check` and anything else that connects.

The reading is redis-py's own (`redis.asyncio.connection.parse_url`, what `Redis.from_url` does), so every form
redis-py accepts means the same thing everywhere:
    redis://[[user]:password@]host[:port][/db]     rediss://... (TLS)     unix://[[user]:password@]/path/to.sock
and its query parameters (`?password=`, `?username=`, `?db=`, `?socket_connect_timeout=`, `?ssl_cert_reqs=`,
`?ssl_ca_certs=`, ...). Credentials in the user-info part win over the query's, as in redis-py.

`connection_pool(url)` is the asyncio pool the worker's and the Client's clients are built on (every option of
the URL holds). `arq_settings(url)` is arq's `RedisSettings` (what `arq --check` and `arq.create_pool` take):
arq has no field for some of redis-py's options (`socket_timeout`, `socket_keepalive`, `health_check_interval`,
`client_name`, `protocol`); they tune a connection, not where it goes or how it authenticates, and only these
`RedisSettings` go without them. `sync_client(url)` is a blocking redis-py client (the demo, the local-Redis probe).
A URL redis-py does not accept raises `BadRedisURL` naming the URL with its credentials redacted
(statecache.protocol.redact).

Knows redis-py's URL forms and arq's `RedisSettings`; nothing of jobs, keys or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from arq.connections import RedisSettings
from redis.asyncio.connection import ConnectionPool, SSLConnection, parse_url

from statecache.protocol import redact


class BadRedisURL(ValueError):
    """A Redis URL redis-py does not accept (scheme, a query value of the wrong type); the message shows it redacted."""


# redis-py's option -> arq RedisSettings' field, for those arq has a field for
_ARQ_FIELDS = {
    "host": "host", "port": "port", "path": "unix_socket_path", "db": "database", "username": "username",
    "password": "password", "ssl_keyfile": "ssl_keyfile", "ssl_certfile": "ssl_certfile",
    "ssl_cert_reqs": "ssl_cert_reqs", "ssl_ca_certs": "ssl_ca_certs", "ssl_ca_data": "ssl_ca_data",
    "ssl_check_hostname": "ssl_check_hostname", "socket_connect_timeout": "conn_timeout",
    "max_connections": "max_connections", "retry_on_timeout": "retry_on_timeout",
}


@dataclass(repr=False)
class URLRedisSettings(RedisSettings):
    """arq's RedisSettings, with a repr that hides the password (arq's shows it)."""

    def __repr__(self) -> str:
        shown = {k: ("***" if k == "password" and v else v) for k, v in self.__dict__.items()}
        return "RedisSettings({})".format(", ".join(f"{k}={v!r}" for k, v in shown.items()))


def url_options(url: str) -> dict[str, Any]:
    """What redis-py reads from `url`: its connection keyword arguments (`connection_class` for TLS and unix
    sockets). Raises BadRedisURL."""
    try:
        return dict(parse_url(url))
    except (ValueError, TypeError) as e:
        raise BadRedisURL(f"{redact(url)} is not a Redis URL redis-py accepts ({redact(e)}); forms: "
                          "redis://[[user]:password@]host[:port][/db], rediss://... (TLS), "
                          "unix://[[user]:password@]/path/to.sock, query parameters such as ?password=...&db=0") from None


def connection_pool(url: str, **defaults: Any) -> ConnectionPool:
    """A redis.asyncio ConnectionPool for `url`; `defaults` (e.g. socket_connect_timeout) apply where the URL does not
    set them. Raises BadRedisURL."""
    return ConnectionPool(**{**defaults, **url_options(url)})


def sync_client(url: str, **defaults: Any) -> redis.Redis:
    """A blocking redis-py client for `url` (the same reading; `defaults` as in connection_pool). Raises BadRedisURL."""
    url_options(url)  # the same check and message
    return redis.Redis.from_url(url, **defaults)  # redis-py's from_url: the URL's options win over `defaults`


def arq_settings(url: str, **fields: Any) -> URLRedisSettings:
    """arq's RedisSettings for `url` (for `arq ... --check` and arq.create_pool); `fields` (RedisSettings' names, e.g.
    conn_retries) are set on it. Raises BadRedisURL."""
    options = url_options(url)
    values = {_ARQ_FIELDS[k]: v for k, v in options.items() if k in _ARQ_FIELDS}
    values["ssl"] = issubclass(options.get("connection_class", object), SSLConnection)
    return URLRedisSettings(**{**values, **fields})
