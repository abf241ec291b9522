"""The key and project services."""

import pytest

from coordination.domain import exceptions
from coordination.services.keys import api_key_authenticate, api_key_create, api_key_revoke, project_ensure

pytestmark = pytest.mark.django_db


def test_project_ensure_is_idempotent_and_validates_the_name():
    assert project_ensure(name="acme").id == project_ensure(name="acme").id
    for bad in ("", "my project", "x" * 101, "ünï"):
        with pytest.raises(exceptions.ValidationFailed):
            project_ensure(name=bad)


def test_keys_authenticate_until_revoked_and_store_only_a_hash():
    project = project_ensure(name="acme")
    issued = api_key_create(project_id=project.id, permissions=["coordination_read"])
    assert issued.plaintext.startswith(f"rs_{issued.api_key.prefix}_")
    assert issued.plaintext not in issued.api_key.key_hash
    assert api_key_authenticate(issued.plaintext).id == issued.api_key.id
    assert api_key_authenticate(issued.plaintext + "x") is None
    api_key_revoke(api_key_id=issued.api_key.id)
    assert api_key_authenticate(issued.plaintext) is None
