"""``DATABASE_URL`` parsing that keeps a multi-host URL whole (failover to a standby).

``dj_database_url.parse`` reads one ``host:port`` and refuses
``postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write`` (the port is not a
number). libpq takes several hosts as comma-separated ``host`` and ``port`` lists and tries
them in turn; with ``target_session_attrs=read-write`` it keeps only a server that accepts
writes, so every new connection finds the primary after a standby is promoted. Here such a
URL is parsed with one placeholder host, and ``HOST`` / ``PORT`` are then set to the whole lists,
which Django's PostgreSQL backend hands to psycopg as they are (``host="h1,h2"``,
``port="5432,5432"``); the query (``target_session_attrs``...) lands in ``OPTIONS`` as usual.
"""

from urllib.parse import unquote, urlsplit, urlunsplit

import dj_database_url


def _hosts_and_ports(netloc: str) -> tuple[str, list[str], list[str]]:
    """Split ``user:pw@h1:p1,h2:p2`` into the credentials part and the host and port lists."""
    credentials, _, hosts = netloc.rpartition("@")
    names, ports = [], []
    for entry in hosts.split(","):
        if entry.startswith("["):  # [::1]:5432
            name, _, rest = entry[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            name, _, port = entry.partition(":")
        names.append(unquote(name))
        ports.append(port)
    return credentials, names, ports


def parse(url: str, **kwargs) -> dict:
    """Return Django's ``DATABASES`` entry for ``url`` (``dj_database_url.parse``'s keywords), several hosts kept."""
    parts = urlsplit(url)
    if "," not in parts.netloc:
        return dj_database_url.parse(url, **kwargs)
    credentials, names, ports = _hosts_and_ports(parts.netloc)
    # dj_database_url reads the rest from the URL with one placeholder host; the lists replace it.
    single = (f"{credentials}@" if credentials else "") + "multi-host"
    parsed = dj_database_url.parse(urlunsplit(parts._replace(netloc=single)), **kwargs)
    parsed["HOST"] = ",".join(names)
    # libpq wants one port for all or one per host; an empty entry means the default (5432).
    parsed["PORT"] = ",".join(ports) if any(ports) else ""
    return parsed
