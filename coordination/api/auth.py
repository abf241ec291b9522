"""Bearer API-key authentication and per-view permissions."""

from dataclasses import dataclass

from django.utils import timezone
from rest_framework import authentication, permissions
from rest_framework.exceptions import AuthenticationFailed

from coordination.models import ApiKey
from coordination.selectors import Visibility
from coordination.services.keys import api_key_authenticate
from coordination.states import Permission

# Touch last_used_at at most this often, so a busy key does not write on every request.
LAST_USED_GRANULARITY_S = 60


UNUSABLE_KEY = "Invalid, revoked or expired API key."
AUTHENTICATE_HEADER = 'Bearer realm="runstate"'


def bearer_key(header: bytes) -> str | None:
    """Return the key of an ``Authorization: Bearer <key>`` value, or None for no value.

    Raise ``AuthenticationFailed`` for a value of another shape.
    """
    parts = header.split()
    if not parts:
        return None
    if parts[0].lower() != ApiKeyAuthentication.keyword.lower().encode() or len(parts) != 2:
        raise AuthenticationFailed("Use 'Authorization: Bearer <key>'.")
    try:
        return parts[1].decode("ascii")
    except UnicodeDecodeError:
        raise AuthenticationFailed("Invalid API key.") from None


@dataclass(frozen=True)
class Principal:
    """The caller behind a request: one API key of one project."""

    api_key: ApiKey

    is_authenticated = True
    is_anonymous = False

    @property
    def visibility(self) -> Visibility:
        """Return what this key can see."""
        bound = self.api_key.run.path if self.api_key.run_id else None
        return Visibility(project_id=self.api_key.project_id, bound_path=bound)


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer rs_<prefix>_<secret>``."""

    keyword = "Bearer"

    def authenticate(self, request):  # noqa: D102
        plaintext = bearer_key(authentication.get_authorization_header(request))
        if plaintext is None:
            return None
        api_key = api_key_authenticate(plaintext)
        if api_key is None:
            raise AuthenticationFailed(UNUSABLE_KEY)
        now = timezone.now()
        if api_key.last_used_at is None or (now - api_key.last_used_at).total_seconds() > LAST_USED_GRANULARITY_S:
            ApiKey.objects.filter(id=api_key.id).update(last_used_at=now)
        return Principal(api_key), api_key

    def authenticate_header(self, request):  # noqa: D102
        return AUTHENTICATE_HEADER


class HasKeyPermission(permissions.BasePermission):
    """Require the permission a view names for the request's method.

    A view sets ``required_permissions = {"GET": Permission.COORDINATION_READ, ...}``; a
    method it does not name needs ``coordination_write``.
    """

    message = "The API key lacks the permission for this operation."

    def has_permission(self, request, view):  # noqa: D102
        principal = request.user
        if not isinstance(principal, Principal):
            return False
        needed = getattr(view, "required_permissions", {}).get(request.method, Permission.COORDINATION_WRITE)
        if request.method in ("HEAD", "OPTIONS"):
            needed = getattr(view, "required_permissions", {}).get("GET", needed)
        if not principal.api_key.has_permission(needed):
            self.message = f"The API key lacks the '{needed}' permission."
            return False
        return True
