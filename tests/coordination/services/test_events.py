"""``events_record_many``: every event carries its transaction's id, however many are written."""

import pytest
from django.db import connection, transaction
from django.utils import timezone

from coordination.models import Event
from coordination.services.events import READ_TXID_ONCE_FROM, events_record_many
from coordination.services.runs import run_create

pytestmark = pytest.mark.django_db


@pytest.mark.postgres_only
@pytest.mark.parametrize("count", [1, READ_TXID_ONCE_FROM - 1, READ_TXID_ONCE_FROM, 50])
def test_every_event_carries_the_id_of_the_transaction_that_wrote_it(project, count):
    run = run_create(project_id=project.id)
    kind = f"test.batch-{count}"
    with transaction.atomic():
        events_record_many(
            [
                Event(project_id=project.id, type=kind, run_id=run.id, run_path=run.path, created_at=timezone.now())
                for _ in range(count)
            ]
        )
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_xact_id()::text::bigint")
            txid = cursor.fetchone()[0]
    assert list(Event.objects.filter(type=kind).values_list("txid", flat=True)) == [txid] * count


def test_a_batch_is_written_whole_with_one_txid(project, is_postgres):
    run = run_create(project_id=project.id)
    with transaction.atomic():
        events_record_many(
            [
                Event(
                    project_id=project.id,
                    type="test.whole",
                    run_id=run.id,
                    run_path=run.path,
                    created_at=timezone.now(),
                )
                for _ in range(READ_TXID_ONCE_FROM * 2)
            ]
        )
    txids = list(Event.objects.filter(type="test.whole").values_list("txid", flat=True))
    assert len(txids) == READ_TXID_ONCE_FROM * 2 and len(set(txids)) == 1
    assert (txids[0] > 0) if is_postgres else (txids[0] == 0)  # SQLite serializes writers: no txid
