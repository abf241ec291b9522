"""Names end where the string ends: Python's ``$`` also matches before a final newline.

A mailbox named ``"jobs\\n"`` was created by ``PUT /v1/mailboxes/jobs%0A``, whose answer then
failed on its ``Location`` header: a 500 after the write (tests/api/test_hostile_input.py).
"""

import pytest

from coordination.domain import exceptions
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.pools import pool_get, pool_put
from coordination.services.quotas import quota_get, quota_put
from runstate._tracing import valid_traceparent

pytestmark = pytest.mark.django_db

ENDINGS = ["\n", "\r\n", " ", "\x00"]


@pytest.fixture
def project():
    return project_ensure(name="names")


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_name_with_anything_after_its_last_character_is_refused_by_every_service_that_names(project, ending):
    name = "jobs" + ending
    with pytest.raises(exceptions.ValidationFailed):
        project_ensure(name=name)
    with pytest.raises(exceptions.ValidationFailed):
        mailbox_ensure(project_id=project.id, name=name, mode="WORK")
    with pytest.raises(exceptions.ValidationFailed):
        pool_put(project_id=project.id, name=name, capacity=1)
    with pytest.raises(exceptions.ValidationFailed):
        quota_put(project_id=project.id, name=name, limit=1, period_ms=1000)
    pool_put(project_id=project.id, name="jobs", capacity=1)
    quota_put(project_id=project.id, name="jobs", limit=1, period_ms=1000)
    with pytest.raises(exceptions.NotFound):
        pool_get(project_id=project.id, name=name)
    with pytest.raises(exceptions.NotFound):
        quota_get(project_id=project.id, name=name)


def test_a_traceparent_with_a_final_newline_is_refused():
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert valid_traceparent(traceparent) and not valid_traceparent(traceparent + "\n")
