"""Settings for runstate, read only from the environment.

Every setting has a default that is safe in production and lets a fresh clone run with
nothing configured: a SQLite file under ``var/``, a broker that needs no server, ``DEBUG``
off (``scripts/start`` turns it on) and a secret key generated into ``var/``. Production sets
``DATABASE_URL`` (PostgreSQL), ``CELERY_BROKER_URL`` (Redis or RabbitMQ), ``SECRET_KEY``,
``ALLOWED_HOSTS`` and ``RUNSTATE_HTTPS=1`` (``docs/deploy.md``).
"""

import os
import secrets
from pathlib import Path

from django.utils.csp import CSP

from runstate_project import dburl

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("RUNSTATE_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def env_bool(name: str, default: bool) -> bool:
    """Read a boolean from the environment ("1", "true", "yes", "on" are true)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str) -> list[str]:
    """Read a comma-separated list from the environment."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    # First: its runserver (daphne's ASGI one, runstate_project/management/commands/) replaces
    # Django's WSGI one and staticfiles', so the development server streams SSE and holds
    # long-polls without a thread, like uvicorn. Not daphne's own app: it imports Twisted in
    # every process that sets Django up, and only runserver serves with it.
    "runstate_project",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "coordination",
    "workers",
]

MIDDLEWARE = [
    # First: the request id covers every other middleware's log lines, and the metrics time them.
    "coordination.plumbing.logging.RequestContextMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# The stack of requests under /v1/ (runstate_project/asgi.py): the API authenticates with keys
# and needs no session, CSRF, user or messages middleware.
API_MIDDLEWARE = [
    "coordination.plumbing.logging.RequestContextMiddleware",
    "coordination.api.middleware.ApiSecurityMiddleware",
]

# --- Safe production defaults (issue 25) ---------------------------------------------------
# DEBUG, the secret key, HTTPS and the Content-Security-Policy: ``manage.py check --deploy``
# is clean under the environment docs/deploy.md gives (scripts/check_deploy, which scripts/test
# and tests/operator/test_production_settings.py run), and local development over plain HTTP
# works.

# Off unless set: Django's debug page shows settings and the environment (scripts/start sets
# DEBUG=1 for development and says so).
DEBUG = env_bool("DEBUG", False)


def secret_key_generated(path: Path) -> str:
    """Return the secret key kept in ``path``, creating it (random, readable by its owner only) the first time.

    Processes that share a ``RUNSTATE_VAR_DIR`` (one machine, the test suite and the servers
    it starts) share the key; two creating it at once keep the first one linked in place.
    """
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_urlsafe(50))
    try:
        os.link(draft, path)
    except FileExistsError:
        pass
    finally:
        draft.unlink()
    return path.read_text().strip()


# Production sets SECRET_KEY, the same on every machine (sessions and CSRF tokens signed by one
# API process are checked by another); without it each VAR_DIR has a random key of its own,
# which check --deploy reports (runstate.W001, coordination/plumbing/checks.py).
SECRET_KEY_FILE = VAR_DIR / "secret_key"
SECRET_KEY = os.environ.get("SECRET_KEY") or secret_key_generated(SECRET_KEY_FILE)

# RUNSTATE_HTTPS=1: the service is reached over HTTPS only (TLS at a proxy or the balancer).
# Cookies are then sent over HTTPS only, browsers are told to use nothing else (HSTS), and a
# plain-HTTP request is redirected, except the health checks and metrics a balancer or
# Prometheus sends from inside the network. Each part has its own variable to override it.
RUNSTATE_HTTPS = env_bool("RUNSTATE_HTTPS", False)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", RUNSTATE_HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", RUNSTATE_HTTPS)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", RUNSTATE_HTTPS)
SECURE_REDIRECT_EXEMPT = [r"^v1/(healthz|readyz|metrics)$"]
SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", 31_536_000 if RUNSTATE_HTTPS else 0))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", RUNSTATE_HTTPS)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", RUNSTATE_HTTPS)
# The header a TLS-terminating proxy sets to say the client used HTTPS ("X-Forwarded-Proto":
# it must then set or strip it on every request). Without it, behind such a proxy every
# request looks like plain HTTP and SECURE_SSL_REDIRECT would redirect forever.
RUNSTATE_PROXY_SSL_HEADER = os.environ.get("RUNSTATE_PROXY_SSL_HEADER", "").strip()
if RUNSTATE_PROXY_SSL_HEADER:
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + RUNSTATE_PROXY_SSL_HEADER.upper().replace("-", "_"), "https")

# Content-Security-Policy on every page (the admin, its dashboard, the API docs at /v1/docs):
# scripts only from the service's own static files (none inline); inline styles stay allowed
# (the dashboard's bars and Swagger UI set them). The API stack sets it without a thread hop
# (coordination/api/middleware.py).
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF, CSP.UNSAFE_INLINE],
    "img-src": [CSP.SELF, "data:"],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "frame-ancestors": [CSP.NONE],
    "form-action": [CSP.SELF],
}
MIDDLEWARE.insert(
    MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1,
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
)
API_MIDDLEWARE.append("coordination.api.middleware.ApiContentSecurityPolicyMiddleware")

# The debug page (DEBUG on) hides the credentials inside URL-valued settings and environment
# variables (DATABASE_URL, CELERY_BROKER_URL...), not only settings named like secrets.
DEFAULT_EXCEPTION_REPORTER_FILTER = "runstate_project.debug.CredentialHidingReporterFilter"
# --- end of the safe production defaults ---------------------------------------------------

ROOT_URLCONF = "runstate_project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "runstate_project.wsgi.application"
ASGI_APPLICATION = "runstate_project.asgi.application"

# Database: PostgreSQL when DATABASE_URL is set, otherwise an embedded SQLite file.
# RUNSTATE_SQLITE_PATH points a server at another SQLite file (tests serve their test database).
SQLITE_PATH = Path(os.environ.get("RUNSTATE_SQLITE_PATH") or VAR_DIR / "runstate.sqlite3")
DATABASE_URL = os.environ.get("DATABASE_URL", "")
if DATABASE_URL:
    # Health checks: a connection that died with the server (a restart) is replaced before
    # use, by the pool's check or, for a persistent connection (workers), at the start of a task.
    DATABASES = {"default": dburl.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)}
    # Server-side binding lets psycopg prepare a statement after it has run this many times on
    # a connection ("off": never): the hot single statements are then planned once per
    # connection instead of on every call (docs/benchmarks.md has the measurement). Turn it
    # off behind a pooler in transaction mode that cannot keep prepared statements.
    RUNSTATE_DB_PREPARE_THRESHOLD = os.environ.get("RUNSTATE_DB_PREPARE_THRESHOLD", "1").strip().lower()
    if DATABASES["default"]["ENGINE"].endswith("postgresql"):
        if RUNSTATE_DB_PREPARE_THRESHOLD == "off":
            # Client-side binding, and psycopg never prepares (None: Django's own default).
            DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = None
        else:
            DATABASES["default"].setdefault("OPTIONS", {}).update(
                server_side_binding=True, prepare_threshold=int(RUNSTATE_DB_PREPARE_THRESHOLD)
            )
    # RUNSTATE_DB_POOLER=transaction: DATABASE_URL goes through a pooler in transaction mode
    # (PgBouncer's pool_mode = transaction), so consecutive transactions of one connection may
    # run on different server sessions. Nothing may then rely on a session: prepared
    # statements must be off (checked at start-up: coordination/plumbing/checks.py) and Django's
    # server-side cursors, which outside a transaction are WITH HOLD cursors, are not used.
    # "" (the default) or "session": a direct connection, or a pooler in session mode.
    RUNSTATE_DB_POOLER = os.environ.get("RUNSTATE_DB_POOLER", "").strip().lower()
    if RUNSTATE_DB_POOLER == "transaction":
        DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    RUNSTATE_DB_POOL_SIZE = int(os.environ.get("RUNSTATE_DB_POOL_SIZE", "30"))
    if RUNSTATE_DB_POOL_SIZE > 0 and DATABASES["default"]["ENGINE"].endswith("postgresql"):
        # Under ASGI every request runs in a thread of its own: a burst of requests would
        # open a connection each and exhaust the server's max_connections. The pool caps a
        # process's connections; a request beyond the cap waits for one (up to the timeout),
        # unless the server is down: then it fails at once (runstate_project.postgresql).
        DATABASES["default"]["ENGINE"] = "runstate_project.postgresql"
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": RUNSTATE_DB_POOL_SIZE,
            "timeout": float(os.environ.get("RUNSTATE_DB_POOL_TIMEOUT_S", "30")),
            # While the server is down the pool retries each connection with a doubling
            # backoff, so after a long outage it would wait about as long again before its
            # next try. Give up on a connection after a few seconds instead: the next request
            # asks for a fresh one, so the pool is back within seconds of the server.
            "reconnect_timeout": 5.0,
        }
    # The LISTEN hub's connection (coordination/plumbing/notify.py): one session per API process that
    # must stay on one server backend for as long as it listens, so behind a pooler in
    # transaction mode it goes to PostgreSQL directly (or through a session-mode pool).
    # Default: DATABASE_URL.
    RUNSTATE_LISTEN_DATABASE_URL = os.environ.get("RUNSTATE_LISTEN_DATABASE_URL", "").strip() or DATABASE_URL
    RUNSTATE_LISTEN_DATABASE = dburl.parse(RUNSTATE_LISTEN_DATABASE_URL)
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": SQLITE_PATH,
            "OPTIONS": {
                # IMMEDIATE takes the write lock when a transaction begins, so a cancel's
                # cascade can never interleave with another writer (SQLite has no row locks).
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            "TEST": {"NAME": str(VAR_DIR / "test-runstate.sqlite3")},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# Serve static files (admin, API docs) from the ASGI app itself, so the embedded service
# needs no web server in front; production may turn it off behind a proxy or CDN-free cache.
RUNSTATE_SERVE_STATIC = env_bool("RUNSTATE_SERVE_STATIC", True)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["coordination.api.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["coordination.api.auth.HasKeyPermission"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["coordination.api.parsers.SafeJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "coordination.api.errors.exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["coordination.api.throttling.ApiKeyRateThrottle"],
    "UNAUTHENTICATED_USER": None,
    "DATETIME_FORMAT": "%Y-%m-%dT%H:%M:%S.%fZ",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "runstate API",
    "DESCRIPTION": "Coordination for swarms of workers and agents: runs, work, groups, barriers, timers.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "coordination.api.schema.add_transport_errors",
        "coordination.api.schema.constrain_name_parameters",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RunStateEnum": "coordination.domain.states.RunState",
        "TaskStateEnum": "coordination.domain.states.TaskState",
        "GroupStateEnum": "coordination.domain.states.GroupState",
        "MessageStateEnum": "coordination.domain.states.MessageState",
        "BarrierStateEnum": "coordination.domain.states.BarrierState",
        "TimerStateEnum": "coordination.domain.states.TimerState",
    },
}

# Celery: the database is the source of truth, broker messages only wake workers.
# With nothing configured, the filesystem transport needs no server.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
CELERY_BROKER_DIR = VAR_DIR / "broker"
if CELERY_BROKER_URL.startswith("filesystem://"):
    for sub in ("queue", "processed", "control"):
        (CELERY_BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_BROKER_DIR / "queue"),
        "data_folder_out": str(CELERY_BROKER_DIR / "queue"),
        "processed_folder": str(CELERY_BROKER_DIR / "processed"),
        "control_folder": str(CELERY_BROKER_DIR / "control"),
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A request that dispatches a wake-up must not hang on a broker that is down: give up fast,
# the sweeps act on everything due anyway.
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
# django-celery-beat's scheduler (the sweeps live in its tables, seen in the admin), whose ticks
# outlive a database error: workers/beat.py.
CELERY_BEAT_SCHEDULER = "workers.beat:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"

# runstate's own knobs.
RUNSTATE_DEFAULT_CHILD_LIMIT = int(os.environ.get("RUNSTATE_DEFAULT_CHILD_LIMIT", "1000"))
RUNSTATE_MAX_WAIT_MS = 30_000
# Timers and deadlines due within this horizon get an ETA message at creation; later ones
# get it from the periodic dispatch of upcoming timers (the 1 s sweep covers both anyway).
RUNSTATE_ETA_HORIZON_S = int(os.environ.get("RUNSTATE_ETA_HORIZON_S", "300"))
RUNSTATE_EVENT_RETENTION_DAYS = int(os.environ.get("RUNSTATE_EVENT_RETENTION_DAYS", "7"))
# PostgreSQL: the event table's daily partitions beat keeps created ahead of today (UTC).
RUNSTATE_EVENT_PARTITIONS_AHEAD_DAYS = int(os.environ.get("RUNSTATE_EVENT_PARTITIONS_AHEAD_DAYS", "3"))
# Requests per API key per window ("<count>/<s|min|h|day>"; "off" disables): 429 RATE_LIMITED beyond.
# A batch counts its items. The default is twice what one key drives through a two-process
# API in bench.throughput's batched scenario (about 5,000 items/s), so a busy worker is
# never throttled by it (docs/operations.md).
RUNSTATE_RATE_LIMIT = os.environ.get("RUNSTATE_RATE_LIMIT", "600000/min")
# A bearer token for Prometheus: /v1/metrics answers it every project's series (a project's key
# gets its own project's). Empty: no token, only keys read metrics (docs/operations.md).
RUNSTATE_METRICS_TOKEN = os.environ.get("RUNSTATE_METRICS_TOKEN", "")
# Failed admin logins allowed per username and per client address in a window, the same
# "<count>/<period>" form ("off" turns it off); counted like the rate limit above
# (coordination/admin/login.py).
RUNSTATE_ADMIN_LOGIN_LIMIT = os.environ.get("RUNSTATE_ADMIN_LOGIN_LIMIT", "5/15min")
# Seconds an API process keeps an API key or mailbox it read (0: off). A change to either row
# reaches every process through NOTIFY at once (coordination/plumbing/process_cache.py); this bounds
# how long an entry lives regardless.
RUNSTATE_PROCESS_CACHE_S = float(os.environ.get("RUNSTATE_PROCESS_CACHE_S", "5"))
# The API's hot path (coordination/api/hot): claim (a waiting one parked on the loop), complete, fail, release,
# renew, submit, their batches, the task result, group, barrier and timer waits, the event
# long-poll and the event stream answered on the event loop with one statement on an async connection pool of
# RUNSTATE_HOT_POOL_SIZE connections per process. "off" sends every request through DRF; on SQLite it is always off.
RUNSTATE_HOT_PATH = os.environ.get("RUNSTATE_HOT_PATH", "on").strip().lower() != "off"
RUNSTATE_HOT_POOL_SIZE = int(os.environ.get("RUNSTATE_HOT_POOL_SIZE", "10"))
RUNSTATE_HOT_POOL_TIMEOUT_S = float(os.environ.get("RUNSTATE_HOT_POOL_TIMEOUT_S", "30"))
# Long-polls and event streams one API key may hold open at once in one API process (0: no
# cap): 429 RATE_LIMITED beyond (coordination/api/waits.py). tests/concurrency and bench/
# hold at most 1,000 waits of one key in a process.
RUNSTATE_MAX_WAITS_PER_KEY = int(os.environ.get("RUNSTATE_MAX_WAITS_PER_KEY", "1000"))
# Seconds without events after which an event stream sends a keepalive comment.
RUNSTATE_SSE_HEARTBEAT_S = float(os.environ.get("RUNSTATE_SSE_HEARTBEAT_S", "15"))
# Recent events an API process keeps for its event streams; a stream that falls further behind is dropped.
RUNSTATE_SSE_BUFFER = int(os.environ.get("RUNSTATE_SSE_BUFFER", "10000"))
# Seconds an event stream may stall on a reader that takes nothing before its connection is closed.
RUNSTATE_SSE_STALL_S = float(os.environ.get("RUNSTATE_SSE_STALL_S", "10"))

# A task's admin page links its trace id here: a URL with ``{trace_id}`` (a Jaeger or Tempo trace view).
RUNSTATE_TRACE_URL = os.environ.get("RUNSTATE_TRACE_URL", "").strip()

# One JSON object per line with the request id (LOG_FORMAT=text for plain lines).
LOG_FORMAT = os.environ.get("LOG_FORMAT", "json")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "request_id": {"()": "coordination.plumbing.logging.RequestIdFilter"},
        "redact": {"()": "coordination.plumbing.logging.RedactFilter"},
    },
    "formatters": {
        "json": {"()": "coordination.plumbing.logging.JsonFormatter"},
        "text": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "filters": ["request_id", "redact"],
            "formatter": "text" if LOG_FORMAT == "text" else "json",
        }
    },
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
}
