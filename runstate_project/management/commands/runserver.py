"""``manage.py runserver``: daphne's ASGI development server, loaded only by the command itself.

daphne's own app (``INSTALLED_APPS = ["daphne", ...]``) imports ``daphne.server``, and with it
Twisted's reactor, in every process that sets Django up: a server, a Celery worker, beat, a
management command, a test process, each paying 0.28 s of CPU (measured idle; more on a busy
machine) for a server only ``runserver`` uses. Django finds this command from ``runstate_project``'s place in
``INSTALLED_APPS`` (before ``django.contrib.staticfiles``, whose ``runserver`` it replaces) and
imports this module only when ``runserver`` is the command run.
"""

from daphne.management.commands.runserver import Command

__all__ = ["Command"]
