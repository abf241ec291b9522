"""What Django's debug page (``DEBUG`` on) may show: no credential inside a URL.

Django's ``SafeExceptionReporterFilter`` hides a setting, an environment variable (in a
WSGI request's ``META``) or a dictionary entry by its *name* (``PASSWORD``, ``SECRET``,
``KEY``...). ``DATABASE_URL`` and ``CELERY_BROKER_URL`` are not named so, but carry the
database's and broker's passwords in their userinfo (``postgres://user:password@host/db``).
``CredentialHidingReporterFilter`` also masks the userinfo of every URL inside what it
shows: settings at any depth, the request's ``META``, and the local variables of the
traceback's frames (whose dictionaries it also cleanses by name, as settings).
"""

import re
from pprint import pformat

from django.views.debug import SafeExceptionReporterFilter

# The userinfo of a URL: after "://", up to the last "@" before the host ends ("/", "?",
# "#" or a space), so a password holding "@" or ":" is masked whole. Anchored on the
# literal "://" and bounded by characters it cannot cross, the search is linear in the text.
_URL_USERINFO = re.compile(r"://[^/?#\s]*@")


def hide_url_credentials(text: str) -> str:
    """Return ``text`` with the userinfo (user and password) of every URL in it masked."""
    return _URL_USERINFO.sub(f"://{SafeExceptionReporterFilter.cleansed_substitute}@", text)


class _Shown:
    """A value shown by its already masked representation (the debug page prints ``repr``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class CredentialHidingReporterFilter(SafeExceptionReporterFilter):
    """Django's filter, plus the credentials inside URL-valued strings (see the module)."""

    def cleanse_setting(self, key, value):
        """Cleanse as Django does by name, then mask the credentials of every URL in a string."""
        cleansed = super().cleanse_setting(key, value)
        if isinstance(cleansed, str):
            return hide_url_credentials(cleansed)
        return cleansed

    def get_traceback_frame_variables(self, request, tb_frame):
        """Cleanse each local variable's entries as a setting's, and mask URLs in what it prints as."""
        shown = []
        for name, value in super().get_traceback_frame_variables(request, tb_frame):
            if isinstance(value, dict | list | tuple | str):
                value = self.cleanse_setting("", value)
            try:
                text = pformat(value)
            except Exception:  # noqa: BLE001 - an unprintable value is Django's to report, as it does
                shown.append((name, value))
                continue
            masked = hide_url_credentials(text)
            shown.append((name, value if masked == text else _Shown(masked)))
        return shown
