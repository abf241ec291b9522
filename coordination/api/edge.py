"""What the API checks before it reads a request's body: its size and, where a key is needed, the key.

Reading a body costs the server memory or a temporary file, so nobody gets that far without
the right to: ``runstate_project.asgi.ApiASGIHandler`` asks ``refusal`` first, and reads
through ``bounded``.

- A declared ``Content-Length`` over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is answered 413 at once.
- A body sent without a length (chunked) is read up to that limit and no further
  (``BodyTooLarge``, answered 413).
- A request with a body to an endpoint that needs a key is answered 401 unless it carries a
  usable one, before any of the body is read. The key is looked up in the process cache on
  the event loop, and only on a miss in the request's thread (the database). The view
  authenticates the request again as usual (a cache hit by then).

A refusal closes the connection (``Connection: close``): the unread body is never read.
Requests without a body (the health checks, the schema, every ``GET``) go on unchecked; their
view answers as before. The answers have the views' envelope (``coordination/api/errors.py``).
"""

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections
from django.http import JsonResponse
from rest_framework.exceptions import AuthenticationFailed, NotAuthenticated

from coordination.api.auth import AUTHENTICATE_HEADER, UNUSABLE_KEY, bearer_key
from coordination.api.errors import body_too_large, database_unavailable, envelope
from coordination.services.keys import api_key_authenticate, cached_key


class BodyTooLarge(Exception):
    """The body went past ``DATA_UPLOAD_MAX_MEMORY_SIZE`` while it was read."""


def body_limit() -> int | None:
    """Return the most bytes a request body may have (None: no limit)."""
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def header(scope, name: bytes) -> bytes:
    """Return the value of a request header (``name`` in lower case), or ``b""``."""
    return next((value for key, value in scope["headers"] if key.lower() == name), b"")


def refused(status: int, body: dict, headers: dict[str, str] | None = None) -> JsonResponse:
    """Return an answer given before the body is read; it closes the connection."""
    response = JsonResponse(body, status=status)
    for name, value in (headers or {}).items():
        response[name] = value
    response["Content-Length"] = str(len(response.content))
    response["Connection"] = "close"
    return response


def too_large() -> JsonResponse:
    """Return the 413 answer to a body over the limit."""
    return refused(413, body_too_large())


async def refusal(scope, *, needs_key: bool) -> JsonResponse | None:
    """Return the answer refusing this request before its body is read, or None to read on."""
    limit = body_limit()
    declared = header(scope, b"content-length")
    length = int(declared) if declared.isdigit() else None
    if limit is not None and length is not None and length > limit:
        return too_large()
    has_body = bool(length) or b"chunked" in header(scope, b"transfer-encoding").lower()
    if not (has_body and needs_key):
        return None
    try:
        plaintext = bearer_key(header(scope, b"authorization"))
        if plaintext is None:
            raise NotAuthenticated()
        if cached_key(plaintext) is None:
            if await sync_to_async(_authenticate, thread_sensitive=True)(plaintext) is None:
                raise AuthenticationFailed(UNUSABLE_KEY)
    except (NotAuthenticated, AuthenticationFailed) as error:
        return refused(401, envelope("UNAUTHENTICATED", str(error.detail)), {"WWW-Authenticate": AUTHENTICATE_HEADER})
    except (OperationalError, InterfaceError):
        # The key could not be looked up (PostgreSQL down or restarting): answered as a view
        # answers it, 503 with the envelope, never an unhandled 500.
        return refused(503, database_unavailable(), {"Retry-After": "1"})
    return None


def _authenticate(plaintext: str):
    """Look the key up in the database, and give the connection back (a refusal ends no request)."""
    try:
        return api_key_authenticate(plaintext)
    finally:
        close_old_connections()


def bounded(receive, limit: int | None):
    """Wrap an ASGI ``receive`` so that a body past ``limit`` bytes raises ``BodyTooLarge``."""
    if limit is None:
        return receive
    received = 0

    async def receive_within_limit():
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise BodyTooLarge()
        return message

    return receive_within_limit
