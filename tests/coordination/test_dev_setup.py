"""``manage.py runstate_dev_setup``: the development project, key and admin of scripts/start."""

import stat
from io import StringIO

import pytest
from django.contrib.auth import authenticate
from django.core.management import call_command

from coordination.models import Project
from coordination.services.keys import ALL_PERMISSIONS, api_key_authenticate, api_key_revoke


def run_setup() -> list[str]:
    out = StringIO()
    call_command("runstate_dev_setup", stdout=out)
    return out.getvalue().splitlines()


@pytest.fixture
def var_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    return tmp_path


@pytest.mark.django_db
def test_last_line_is_a_key_with_every_permission_of_project_dev(var_dir):
    lines = run_setup()

    key = lines[-1]
    api_key = api_key_authenticate(key)
    assert api_key is not None
    assert api_key.project == Project.objects.get(name="dev")
    assert sorted(api_key.permissions) == sorted(ALL_PERMISSIONS)
    assert api_key.name == "development"
    assert api_key.run_id is None
    key_file = var_dir / "dev-api-key"
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


@pytest.mark.django_db
def test_second_call_prints_the_same_key(var_dir):
    first = run_setup()[-1]
    second = run_setup()[-1]

    assert second == first
    assert Project.objects.get(name="dev").api_keys.count() == 1


@pytest.mark.django_db
def test_revoked_key_is_replaced(var_dir):
    first = run_setup()[-1]
    api_key_revoke(api_key_id=api_key_authenticate(first).id)

    second = run_setup()[-1]

    assert second != first
    assert api_key_authenticate(first) is None
    assert api_key_authenticate(second) is not None
    assert (var_dir / "dev-api-key").read_text().strip() == second


@pytest.mark.django_db
def test_unreadable_key_file_is_replaced(var_dir):
    (var_dir / "dev-api-key").write_text("rs_not_a_key\n")

    key = run_setup()[-1]

    assert api_key_authenticate(key) is not None


@pytest.mark.django_db
def test_admin_password_is_printed_kept_and_reused(var_dir):
    lines = run_setup()

    admin_lines = [line for line in lines if line.startswith("Admin: ")]
    assert len(admin_lines) == 1
    username, password = admin_lines[0].removeprefix("Admin: ").split(" / ")
    assert username == "admin"
    user = authenticate(username="admin", password=password)
    assert user is not None and user.is_superuser and user.is_staff
    password_file = var_dir / "dev-admin-password"
    assert password_file.read_text().strip() == password
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600

    assert f"Admin: admin / {password}" in run_setup()
