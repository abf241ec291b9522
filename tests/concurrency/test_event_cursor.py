"""A cursor reader never skips or repeats an event, even when commits land out of id order."""

import random
import threading
import time

import pytest
from django.db import transaction

from coordination.models import Event
from coordination.selectors import Visibility, event_list
from coordination.services.keys import project_ensure
from coordination.services.runs import run_create
from tests.concurrency.util import run_in_threads

WRITERS = 8
WRITES_PER_WRITER = 25


@pytest.mark.django_db(transaction=True)
def test_reader_sees_every_event_exactly_once_with_8_concurrent_writers():
    """8 writers commit events with random delays between insert and commit.

    Ids are taken at insert time, so commits land out of id order; a reader paging with the
    cursor the whole time must end with exactly the set of committed events, in cursor order,
    with no duplicate and no gap.
    """
    project = project_ensure(name="events")
    visibility = Visibility(project_id=project.id)
    done = threading.Event()

    def writer():
        rng = random.Random()
        for _ in range(WRITES_PER_WRITER):
            with transaction.atomic():
                run_create(project_id=project.id)
                # Hold the transaction open after the event got its id, so later ids commit first.
                time.sleep(rng.uniform(0, 0.01))

    def reader():
        seen, cursor = [], None
        while True:
            finished = done.is_set()
            events, cursor = event_list(visibility, after=cursor, limit=7)
            seen += [e.id for e in events]
            if finished and not events:
                return seen
            if not events:
                time.sleep(0.001)

    def writers_then_signal():
        run_in_threads([writer] * WRITERS)
        done.set()

    _, seen = run_in_threads([writers_then_signal, reader], timeout=300)
    committed = list(Event.objects.filter(project=project).values_list("id", flat=True))
    assert len(committed) == WRITERS * WRITES_PER_WRITER
    assert len(seen) == len(set(seen)), "an event was read twice"
    assert set(seen) == set(committed), f"missed {len(set(committed) - set(seen))} events"
