"""``manage.py runserver`` is daphne's ASGI server, and only that command loads daphne and Twisted.

daphne's own app imported Twisted's reactor into every process that set Django up (servers,
workers, beat, every management command and test process); runstate_project's command module
now imports it only when ``runserver`` runs. tests/operator/test_dev_servers.py proves the
command streams as an ASGI server does.
"""

import subprocess
import sys

import pytest
from daphne.management.commands.runserver import Command as DaphneRunserver
from django.conf import settings
from django.core.management import get_commands, load_command_class

# No database: a process's imports and Django's command table are the same on both.
pytestmark = pytest.mark.single_backend

LOADED = "import sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'daphne', 'twisted'}))"


def test_runserver_is_daphnes_asgi_command():
    assert get_commands()["runserver"] == "runstate_project"
    assert isinstance(load_command_class("runstate_project", "runserver"), DaphneRunserver)
    # Ahead of staticfiles, whose WSGI runserver it replaces (the first app listed wins).
    apps = settings.INSTALLED_APPS
    assert apps.index("runstate_project") < apps.index("django.contrib.staticfiles")


def test_setting_django_up_loads_neither_daphne_nor_twisted():
    setup = f"import django; django.setup(); {LOADED}"
    child = subprocess.run([sys.executable, "-c", setup], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "[]"
    # The check can fail: loading the command loads both.
    command = "import django; django.setup(); from django.core.management import load_command_class; "
    command += f"load_command_class('runstate_project', 'runserver'); {LOADED}"
    child = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "['daphne', 'twisted']"
