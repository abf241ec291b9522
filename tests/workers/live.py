"""Start real Celery worker and beat processes against the test database and a real broker."""

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from django.db import connection

from tests.processes import stop_process_groups

ROOT = Path(__file__).resolve().parents[2]
TEST_BROKER_URL = os.environ.get("RUNSTATE_TEST_WORKER_BROKER_URL", "redis://127.0.0.1:6379/14")


def test_database_url() -> str:
    """Return a DATABASE_URL for the test database the suite is using."""
    s = connection.settings_dict
    auth = s["USER"] or ""
    if s.get("PASSWORD"):
        auth += f":{s['PASSWORD']}"
    host = s["HOST"] or "127.0.0.1"
    port = s["PORT"] or 5432
    return f"postgres://{auth}@{host}:{port}/{s['NAME']}"


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=test_database_url(),
        CELERY_BROKER_URL=TEST_BROKER_URL,
        DJANGO_SETTINGS_MODULE="runstate_project.settings",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def purge_broker() -> None:
    """Drop messages left in the test broker by earlier runs."""
    import redis

    redis.Redis.from_url(TEST_BROKER_URL).flushdb()


@contextmanager
def processes(*commands, log_dir: Path):
    """Run each command (a list) as a child process group; stop them all on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    children = []
    try:
        for index, command in enumerate(commands):
            log = open(log_dir / f"proc{index}.log", "wb")  # noqa: SIM115 - closed below
            child = subprocess.Popen(
                command, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            children.append((child, log))
        yield [child for child, _ in children]
    finally:
        stop_process_groups(child for child, _ in children)
        for _, log in children:
            log.close()


def worker_command(concurrency: int = 4, *, include: tuple[str, ...] = ()) -> list[str]:
    """Return a threads-pool Celery worker's command line; ``include`` names task modules to load."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency}",
        *(f"--include={module}" for module in include),
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
    ]


def beat_command(schedule_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "runstate_project",
        "beat",
        "--loglevel=INFO",
        "--scheduler",
        "workers.beat:DatabaseScheduler",
        "--pidfile",
        str(schedule_dir / "beat.pid"),
    ]
