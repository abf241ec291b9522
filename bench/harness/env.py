"""Where a benchmark runs: its environment, its database, the machine's and the checkout's facts."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/runstate_bench"


RECORD_PATH = ROOT / "docs" / "benchmarks.md"


def bench_environment() -> dict[str, str]:
    """Return the environment the benchmark (and its uvicorn subprocess) runs with.

    DEBUG is off unless the caller set it: with DEBUG on, Django keeps every SQL statement in
    ``connection.queries``, which is not what production pays.
    """
    env = dict(os.environ)
    env.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    env.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")
    env.setdefault("DEBUG", "0")
    env.setdefault("SECRET_KEY", "runstate-bench-not-a-secret")
    env.setdefault("LOG_LEVEL", "WARNING")
    return env


def db_params(url: str) -> dict[str, Any]:
    """Split a database URL into psycopg connection keywords (``dbname`` included)."""
    import dj_database_url

    parsed = dj_database_url.parse(url)
    params = {
        "host": parsed.get("HOST") or None,
        "port": parsed.get("PORT") or None,
        "user": parsed.get("USER") or None,
        "password": parsed.get("PASSWORD") or None,
        "dbname": parsed.get("NAME"),
    }
    return {k: v for k, v in params.items() if v not in (None, "")}


def ensure_database(url: str, name: str | None = None) -> str:
    """Create the database of ``url`` (or ``name`` on the same server) when missing."""
    import psycopg
    from psycopg import sql

    params = db_params(url)
    name = name or params["dbname"]
    admin = {**params, "dbname": "postgres"}
    with psycopg.connect(**admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            print(f"created database {name}")
    return name


def drop_database(url: str) -> None:
    """Drop the database of ``url``; only a benchmark database (its name contains ``bench``)."""
    import psycopg
    from psycopg import sql

    params = db_params(url)
    if "bench" not in params["dbname"]:
        raise SystemExit(f"--fresh-db refuses to drop {params['dbname']!r}: its name has no 'bench' in it")
    with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(params["dbname"])))
    print(f"dropped database {params['dbname']}")


def setup_django(*, fresh: bool = False) -> None:
    """Configure the environment, ``django.setup()`` and migrate the benchmark database."""
    os.environ.update(bench_environment())
    import django
    from django.core.management import call_command

    if os.environ["DATABASE_URL"]:  # empty: the embedded SQLite file (RUNSTATE_SQLITE_PATH), made by migrate
        if fresh:
            drop_database(os.environ["DATABASE_URL"])
        ensure_database(os.environ["DATABASE_URL"])
    django.setup()
    call_command("migrate", verbosity=0)


def truncate_coordination_tables() -> bool:
    """Empty every coordination table when the database is a benchmark database; say whether."""
    from django.apps import apps
    from django.db import connection

    if "bench" not in connection.settings_dict["NAME"]:
        return False
    tables = [m._meta.db_table for m in apps.get_app_config("coordination").get_models()]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(connection.ops.quote_name(t) for t in tables)} CASCADE")
    return True


def server_facts() -> dict[str, str]:
    """Return the PostgreSQL version and the settings that bound commit throughput."""
    from django.db import connection

    facts = {}
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        facts["server_version"] = cursor.fetchone()[0]
        for setting in ("synchronous_commit", "fsync", "shared_buffers", "max_connections"):
            cursor.execute(f"SHOW {setting}")
            facts[setting] = cursor.fetchone()[0]
    return facts


def cpu_model() -> str:
    """Return the CPU model name from /proc/cpuinfo (or the platform's processor)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str:
    """Return the short commit the benchmark ran on (``+dirty`` when the tree has changes).

    ``BENCH_GIT_REVISION`` overrides it (for a copy made with ``git archive``, which has no .git).
    """
    if os.environ.get("BENCH_GIT_REVISION"):
        return os.environ["BENCH_GIT_REVISION"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def django_version() -> str:
    """Return Django's version string."""
    import django

    return django.get_version()
