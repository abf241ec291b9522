"""The admin login form, throttled: too many failures for a username or from an address are refused.

Failures are counted in the API rate limit's windows (``coordination.api.throttling``): in
Redis when the broker is Redis, so every process shares them, else in each process. A
window starts with its first failure and lasts the period of ``RUNSTATE_ADMIN_LOGIN_LIMIT``
(``"5/15min"``: 5 failures per 15 minutes; ``"off"`` turns it off). While the username's or
the address's window is full, every attempt is refused before the password is checked, the
right password included. Successful logins are not counted.

The address is the client's as the ASGI server reports it; behind a proxy, run uvicorn with
``--proxy-headers --forwarded-allow-ips`` (docs/deploy.md) or every user shares the proxy's.
"""

import logging
import math

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError

from coordination.api.throttling import limiter, parse_rate

logger = logging.getLogger(__name__)


class ThrottledAdminAuthenticationForm(AdminAuthenticationForm):
    """The admin's login form, refusing a username or address with too many recent failures."""

    error_messages = {
        **AdminAuthenticationForm.error_messages,
        "throttled": "Too many failed logins for this username or from this address. "
        "Try again in %(minutes)s minute(s).",
    }

    def _windows(self) -> list[str]:
        username = (self.cleaned_data.get("username") or "").casefold()
        address = self.request.META.get("REMOTE_ADDR", "") if self.request is not None else ""
        return [f"admin-login:user:{username}", f"admin-login:address:{address}"]

    def clean(self):  # noqa: D102
        rate = parse_rate(settings.RUNSTATE_ADMIN_LOGIN_LIMIT)
        if rate is None or not (self.cleaned_data.get("username") and self.cleaned_data.get("password")):
            return super().clean()  # off, or no attempt to count (the fields report what is missing)
        windows = self._windows()
        for window in windows:
            # A cost of 0 reads the window's count without adding to it.
            failures, remaining_s = limiter.hit(window, rate, cost=0)
            if failures >= rate.count:
                logger.warning("admin login refused: too many failures (%s)", window.split(":")[1])
                raise ValidationError(
                    self.error_messages["throttled"],
                    code="throttled",
                    params={"minutes": max(1, math.ceil(remaining_s / 60))},
                )
        try:
            return super().clean()
        except ValidationError:
            for window in windows:
                limiter.hit(window, rate)
            raise
