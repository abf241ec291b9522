"""The examples' answers to a misconfigured service: a hint on stderr, exit status 2, nothing left running.

One ``scripts/start --no-worker`` without ``RUNSTATE_TASK_MODULES`` is wrong for both: the
Celery example finds that the API does not know its decorated task, and no worker attaches to
the ``runstate worker`` example's group. Each driver cancels the run it created.
"""

import pytest

from coordination.models import Run, Task
from tests.examples.live import finish, shell, started
from tests.examples.test_review_swarm import REVIEW as CELERY_REVIEW
from tests.examples.test_review_swarm_workers import REVIEW as WORKERS_REVIEW

pytestmark = pytest.mark.django_db(transaction=True)


def test_examples_explain_a_service_they_cannot_use_and_cancel_their_run(tmp_path):
    with started("scripts/start --no-worker", tmp_path) as service:
        output = tmp_path / "celery.out"
        reviewer = shell(CELERY_REVIEW, service.env(), output)
        printed = finish(reviewer, output, waits=1)
        assert reviewer.returncode == 2, printed
        assert "RUNSTATE_TASK_MODULES=examples.review_swarm.tasks scripts/start" in printed
        (run,) = Run.objects.filter(name="review swarm")
        assert run.stored_state == "CANCELLED"
        # The draft the schema should have refused was accepted, then cancelled with its run.
        assert list(Task.objects.filter(run=run).values_list("state", flat=True)) == ["CANCELLED"]

        output = tmp_path / "workers.out"
        reviewer = shell(f"{WORKERS_REVIEW} --start-timeout 2", service.env(), output)
        printed = finish(reviewer, output, waits=1)
        assert reviewer.returncode == 2, printed
        assert "No draft started within 2 s: no worker on run" in printed
        (run,) = Run.objects.filter(name="review swarm (runstate worker)")
        assert run.stored_state == "CANCELLED"
        drafts = Task.objects.filter(mailbox__name="worker-drafts")
        assert drafts.count() == 12
        assert set(drafts.values_list("state", flat=True)) == {"CANCELLED"}
