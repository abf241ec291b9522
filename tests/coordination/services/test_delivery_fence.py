"""A delivery's fence says the same thing as the careful path's test and in ``EXTEND_SQL``.

``messages.DELIVERY_HOLDS`` is called on the locked message by ``_lock_delivery`` and rendered
into the extend's single statement. Here both forms are evaluated on a table of messages
covering the fence's inputs (every state, attempt behind, current and ahead, visibility
past, exactly now and ahead) and must agree row by row, and the statement must carry the
rendered rule. PostgreSQL only: the SQL form is PostgreSQL's.
"""

import itertools
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import MessageState
from coordination.models import Message
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import DELIVERY_HOLDS, EXTEND_SQL, message_send
from coordination.services.runs import run_create

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

ATTEMPT = 2


def test_the_fence_agrees_in_python_and_sql_on_every_input():
    project = project_ensure(name="delivery-fence")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="inbox", mode="QUEUE")
    run = run_create(project_id=project.id)
    base, _ = message_send(project_id=project.id, mailbox=mailbox, run_id=run.id, body={})
    now = timezone.now()
    fields = {field.attname: getattr(base, field.attname) for field in Message._meta.concrete_fields}
    visibilities = (now - timedelta(seconds=5), now, now + timedelta(seconds=5))
    messages = [
        Message(**{**fields, "id": uuid7(), "state": state, "attempts": attempts, "visible_at": visible_at})
        for state, attempts, visible_at in itertools.product(MessageState, (1, ATTEMPT, 3), visibilities)
    ]
    Message.objects.bulk_create(messages)

    condition = DELIVERY_HOLDS.sql("m", attempt="%(attempt)s")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT m.id FROM coordination_message m WHERE m.id = ANY(%(ids)s) AND coalesce(({condition}), false)",
            {"ids": [message.id for message in messages], "now": now, "attempt": ATTEMPT},
        )
        in_sql = {row[0] for row in cursor.fetchall()}
    in_python = {message.id for message in messages if DELIVERY_HOLDS(message, now, attempt=ATTEMPT)}

    assert in_sql == in_python
    # The table reaches both answers: only the in-flight, current, still hidden ones hold.
    assert len(in_python) == 1 and len(messages) - len(in_python) > 1
    assert condition in EXTEND_SQL
