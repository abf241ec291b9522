"""Bearer API-key authentication (and the metrics scrape token) and per-view permissions."""

import hmac
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone
from rest_framework import authentication, permissions
from rest_framework.exceptions import AuthenticationFailed

from coordination.domain.states import Permission
from coordination.models import ApiKey
from coordination.reads.selectors import Visibility
from coordination.services.keys import api_key_authenticate

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


def last_used_due(api_key: ApiKey, now) -> bool:
    """Tell whether a request now should record itself in the key's ``last_used_at`` (a write)."""
    return api_key.last_used_at is None or (now - api_key.last_used_at).total_seconds() > LAST_USED_GRANULARITY_S


def permission_needed(view_class: type, method: str) -> str:
    """Return the permission ``view_class`` needs for ``method``: as it names it, else ``coordination_write``."""
    return getattr(view_class, "required_permissions", {}).get(method, Permission.COORDINATION_WRITE)


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


@dataclass(frozen=True)
class MetricsScraper:
    """The caller that presented ``RUNSTATE_METRICS_TOKEN``: Prometheus, which sees every project's metrics."""

    is_authenticated = True
    is_anonymous = False


class MetricsTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <RUNSTATE_METRICS_TOKEN>``, for ``/v1/metrics`` only.

    Anything else (an API key, a wrong token) is left to ``ApiKeyAuthentication``, listed
    after this one, which refuses what is not a usable key.
    """

    def authenticate(self, request):  # noqa: D102
        token = settings.RUNSTATE_METRICS_TOKEN
        if not token:
            return None
        header = authentication.get_authorization_header(request).split()
        if len(header) != 2 or header[0].lower() != b"bearer":
            return None
        # Constant time: how much of a guess matched must not show in the answer's timing.
        if hmac.compare_digest(header[1], token.encode()):
            return MetricsScraper(), None
        return None

    def authenticate_header(self, request):  # noqa: D102
        return 'Bearer realm="runstate"'


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
        if last_used_due(api_key, now):
            ApiKey.objects.filter(id=api_key.id).update(last_used_at=now)
        return Principal(api_key), api_key

    def authenticate_header(self, request):  # noqa: D102
        return AUTHENTICATE_HEADER


class HasKeyPermission(permissions.BasePermission):
    """Require the permission a view names for the request's method, and keep bound keys to their subtree.

    A view sets ``required_permissions = {"GET": Permission.COORDINATION_READ, ...}``; a
    method it does not name needs ``coordination_write``. A view whose methods reach the
    whole project (configuring a mailbox, pool or quota; reading a quota's level) names them
    in ``project_wide = {"PUT", ...}``: a key bound to a run is refused them with
    ``PERMISSION_DENIED`` (``Visibility.require_project_wide``), whatever the body or name.
    """

    message = "The API key lacks the permission for this operation."

    def has_permission(self, request, view):  # noqa: D102
        principal = request.user
        if not isinstance(principal, Principal):
            return False
        needed = permission_needed(view, request.method)
        if request.method in ("HEAD", "OPTIONS"):
            needed = getattr(view, "required_permissions", {}).get("GET", needed)
        if not principal.api_key.has_permission(needed):
            self.message = f"The API key lacks the '{needed}' permission."
            return False
        method = "GET" if request.method in ("HEAD", "OPTIONS") else request.method
        if method in getattr(view, "project_wide", ()) and principal.api_key.run_id is not None:
            principal.visibility.require_project_wide()
        return True


class CanReadMetrics(HasKeyPermission):
    """The scrape token, or a project-wide key with ``coordination_read`` (``/v1/metrics``).

    A key bound to a run is refused: the metrics are per project (mailboxes, pools, quotas are
    the project's), wider than the subtree such a key may see.
    """

    def has_permission(self, request, view):  # noqa: D102
        if isinstance(request.user, MetricsScraper):
            return True
        if not super().has_permission(request, view):
            return False
        if request.user.api_key.run_id is not None:
            self.message = "A key bound to a run cannot read metrics: they cover the whole project."
            return False
        return True
