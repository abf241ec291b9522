"""A review swarm: Celery workers draft in parallel, a reviewer accepts five, the rest stop mid-run.

``tasks.py`` declares the drafting handler (``@runstate_task``); ``__main__.py`` is the
driver, which talks to a running service over HTTP only. See the README's "Example" section.
"""

# Shared by the handler (tasks.py, imported by the service) and the driver (HTTP only, no Django).
MAILBOX = "drafts"
