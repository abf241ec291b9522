"""``manage.py create_api_key``: a key printed alone on the last line, stored only hashed."""

import uuid
from datetime import UTC, datetime
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from coordination.models import ApiKey, Project
from coordination.services.keys import api_key_authenticate
from coordination.services.runs import run_create
from tests.conftest import secret_of


def create_api_key(*args: str) -> list[str]:
    out = StringIO()
    call_command("create_api_key", *args, stdout=out)
    return out.getvalue().splitlines()


@pytest.mark.django_db
def test_last_line_is_a_key_with_the_given_permissions_of_an_ensured_project():
    lines = create_api_key("--project", "acme", "--permissions", "coordination_write,coordination_read")

    api_key = api_key_authenticate(lines[-1])
    assert api_key is not None
    assert api_key.project == Project.objects.get(name="acme")
    assert api_key.permissions == ["coordination_read", "coordination_write"]
    assert api_key.run_id is None
    assert api_key.expires_at is None
    assert len(lines) == 2
    assert "acme" in lines[0] and "coordination_read, coordination_write" in lines[0]
    assert lines[-1] not in lines[0]


@pytest.mark.django_db
def test_an_existing_project_is_reused(project):
    lines = create_api_key("--project", project.name, "--permissions", "resource_config")

    assert api_key_authenticate(lines[-1]).project == project
    assert Project.objects.count() == 1


@pytest.mark.django_db
def test_run_binds_the_key_and_name_and_expiry_are_kept(project):
    run = run_create(project_id=project.id)

    lines = create_api_key(
        "--project",
        project.name,
        "--permissions",
        "coordination_read",
        "--run",
        str(run.id),
        "--name",
        "agent-7",
        "--expires-at",
        "2999-01-02T03:04:05Z",
    )

    api_key = api_key_authenticate(lines[-1])
    assert api_key.run_id == run.id
    assert api_key.name == "agent-7"
    assert api_key.expires_at == datetime(2999, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert str(run.id) in lines[0]
    assert "2999-01-02T03:04:05+00:00" in lines[0]


@pytest.mark.django_db
def test_the_plaintext_is_not_stored_in_the_key_row():
    plaintext = create_api_key("--project", "acme", "--permissions", "coordination_read")[-1]

    secret = secret_of(plaintext)
    row = ApiKey.objects.values().get()
    assert not [name for name, value in row.items() if secret in str(value) or plaintext in str(value)]


@pytest.mark.django_db
@pytest.mark.parametrize("permissions", ["coordination_read,admin", "", " , "])
def test_a_bad_permission_is_refused_naming_the_valid_ones(permissions):
    with pytest.raises(CommandError) as raised:
        create_api_key("--project", "acme", "--permissions", permissions)

    assert "resource_config, coordination_write, coordination_read" in str(raised.value)
    assert not Project.objects.exists()
    assert not ApiKey.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("run_id", [str(uuid.uuid4()), "not-a-run-id"])
def test_an_unknown_run_is_refused(project, run_id):
    with pytest.raises(CommandError, match="--run"):
        create_api_key("--project", project.name, "--permissions", "coordination_read", "--run", run_id)

    assert not ApiKey.objects.exists()


@pytest.mark.django_db
def test_a_run_of_another_project_is_refused_and_creates_no_project(other_project):
    run = run_create(project_id=other_project.id)

    with pytest.raises(CommandError, match="--run"):
        create_api_key("--project", "newcomer", "--permissions", "coordination_read", "--run", str(run.id))

    assert not Project.objects.filter(name="newcomer").exists()
    assert not ApiKey.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("expires_at", ["tomorrow", "2000-01-01T00:00:00Z"])
def test_a_bad_or_past_expiry_is_refused(expires_at):
    with pytest.raises(CommandError, match="--expires-at"):
        create_api_key("--project", "acme", "--permissions", "coordination_read", "--expires-at", expires_at)

    assert not ApiKey.objects.exists()


@pytest.mark.django_db
def test_a_project_name_that_is_not_a_slug_is_refused():
    with pytest.raises(CommandError, match="--project"):
        create_api_key("--project", "my project", "--permissions", "coordination_read")

    assert not Project.objects.exists()
