"""System checks of runstate's own settings: deployment (``manage.py check --deploy``) and database routes."""

import os

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from runstate_project import dburl


@register(Tags.security, deploy=True)
def secret_key_from_the_environment(app_configs, **kwargs):
    """Warn when ``SECRET_KEY`` is not set: the key generated into ``RUNSTATE_VAR_DIR`` is that machine's alone."""
    if os.environ.get("SECRET_KEY"):
        return []
    return [
        Warning(
            "SECRET_KEY is not set: this process signs with the key generated in "
            f"{settings.SECRET_KEY_FILE}, which no other machine has.",
            hint="Set SECRET_KEY to the same 50+ random characters on every machine (docs/deploy.md).",
            id="runstate.W001",
        )
    ]


# Behind a pooler in transaction mode ---------------------------------------------------------
# How the service knows: RUNSTATE_DB_POOLER=transaction says DATABASE_URL goes through one
# (PgBouncer's pool_mode = transaction). A pooler cannot be told from PostgreSQL on the wire,
# so it is said, not guessed (docs/deploy.md, "Behind PgBouncer").
POOLER_MODES = ("", "session", "transaction")


def _route(database: dict) -> tuple:
    """Where a connection goes: a pooler serves one mode per host, port, database and user."""
    return (
        database.get("HOST") or "",
        str(database.get("PORT") or ""),
        database.get("NAME"),
        database.get("USER") or "",
    )


def database_route_errors() -> list[Error]:
    """Return what in the database settings would break behind the pooler ``RUNSTATE_DB_POOLER`` names.

    Run as a system check by every ``manage.py`` command, and at the start of every API
    process, Celery worker and beat (``refuse_unsafe_database_routes``), which then refuse
    to start.
    """
    if not getattr(settings, "DATABASE_URL", ""):
        return []  # SQLite: no pooler
    pooler = settings.RUNSTATE_DB_POOLER
    if pooler not in POOLER_MODES:
        return [
            Error(
                f"RUNSTATE_DB_POOLER={pooler!r} is not a pooler mode runstate knows.",
                hint="Leave it unset for a direct connection, or set 'transaction' or 'session' (docs/deploy.md).",
                id="runstate.E001",
            )
        ]
    if pooler != "transaction":
        return []
    errors = []
    if settings.RUNSTATE_DB_PREPARE_THRESHOLD != "off":
        errors.append(
            Error(
                "RUNSTATE_DB_POOLER=transaction with prepared statements on "
                f"(RUNSTATE_DB_PREPARE_THRESHOLD={settings.RUNSTATE_DB_PREPARE_THRESHOLD}): a statement "
                "prepared in one transaction's server session is missing in the next one's "
                "(PgBouncer 1.18 keeps no prepared statements), so queries would fail at random.",
                hint="Set RUNSTATE_DB_PREPARE_THRESHOLD=off (docs/deploy.md, 'Behind PgBouncer').",
                id="runstate.E002",
            )
        )
    if _route(settings.RUNSTATE_LISTEN_DATABASE) == _route(dburl.parse(settings.DATABASE_URL)):
        errors.append(
            Error(
                "RUNSTATE_DB_POOLER=transaction and the LISTEN connection goes through the same pooler "
                "(RUNSTATE_LISTEN_DATABASE_URL is unset or names DATABASE_URL's host, port, database and "
                "user): the pooler hands its server session to other clients between transactions, so "
                "notifications would be lost "
                "and long-polls and event streams would wake only on their timeouts.",
                hint="Set RUNSTATE_LISTEN_DATABASE_URL to PostgreSQL itself (or a session-mode pool) "
                "(docs/deploy.md, 'Behind PgBouncer').",
                id="runstate.E003",
            )
        )
    return errors


@register(Tags.database)
def database_routes(app_configs, **kwargs):
    """System check: ``database_route_errors``."""
    return database_route_errors()


def refuse_unsafe_database_routes() -> None:
    """Raise ``ImproperlyConfigured`` naming every ``database_route_errors`` (a process's start refuses)."""
    errors = database_route_errors()
    if errors:
        lines = [f"{error.id}: {error.msg} HINT: {error.hint}" for error in errors]
        raise ImproperlyConfigured("runstate refuses to start:\n" + "\n".join(lines))
