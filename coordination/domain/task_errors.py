"""What a task's ``error`` may be, and how to read a code out of it.

``POST /v1/claims/{id}/fail`` stores ``error`` as the worker sent it: any JSON value (an
object, a string, a number, a list, ``null``...), bounded like every payload. Only the
service's own failures have a fixed shape, ``{"code", "message"}`` (``lease_expired``); the
SDK's worker loop sends ``{"type", "message"}`` and the Celery decorator ``{"code",
"message", ...}``. A reader must therefore never assume an object: it calls ``error_code``.
"""


def error_code(error: object) -> str | None:
    """Return ``error["code"]`` when ``error`` is an object whose ``code`` is a string, else None.

    Takes a task's ``error`` (or the ``error`` of a ``task.failed`` / ``task.requeued`` event)
    of any JSON shape: a string, a number, a list, ``null`` or an object without a string code
    all have no code.
    """
    if isinstance(error, dict):
        code = error.get("code")
        if isinstance(code, str):
            return code
    return None
