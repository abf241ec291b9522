"""A stopping API process ends its streams and answers its waits: it exits by itself (``api/draining.py``).

uvicorn waits, on SIGTERM, for every open response to end. Before draining, a worker's claim
watch (which never ends) kept a stopped API process up until its supervisor killed it (15 s
in ``scripts/start``; forever under a bare ``uvicorn``). Here a claim watch, an event stream, a
waiting claim and a group wait are open when the process gets SIGTERM: the streams end
cleanly, each wait is answered as when its wait runs out, and the process exits on its own.
"""

import signal
import subprocess
import threading
import uuid

import httpx
import pytest

from coordination.domain.states import Permission
from coordination.services.groups import group_create
from coordination.services.keys import ALL_PERMISSIONS, api_key_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from tests.operator.live import Reader, uvicorn_server
from tests.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

SCRAPE_TOKEN = f"scrape-{uuid.uuid4().hex}"


def parked(server) -> int:
    text = httpx.get(f"{server.url}/v1/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}).text
    for line in text.splitlines():
        if line.startswith("runstate_waiters_parked "):
            return int(float(line.split()[1]))
    return 0


class Answered:
    """One request sent from a thread; ``response`` once it is answered (or ``error``)."""

    def __init__(self, method: str, url: str, key: str, **kwargs) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None

        def send() -> None:
            try:
                self.response = httpx.request(
                    method, url, headers={"Authorization": f"Bearer {key}"}, timeout=WAIT_S, **kwargs
                )
            except BaseException as error:  # noqa: BLE001 - asserted by the test
                self.error = error

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()


def test_sigterm_ends_the_streams_answers_the_waits_and_the_process_exits_by_itself(project, tmp_path):
    key = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS)).plaintext
    reader_key = api_key_create(project_id=project.id, permissions=[Permission.COORDINATION_READ]).plaintext
    run = run_create(project_id=project.id)
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    mailbox_ensure(project_id=project.id, name="reviews", mode="WORK")
    group = group_create(project_id=project.id, mailbox_name="reviews", condition="N_ACCEPTED", threshold=1)
    (tmp_path / "metrics").mkdir()
    env = {"RUNSTATE_METRICS_TOKEN": SCRAPE_TOKEN, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    with uvicorn_server(tmp_path, **env) as server:
        group_url = f"{server.url}/v1/groups/{group.id}/wait"
        # What each wait answers when its time runs out: what it must answer once the process drains.
        timed_out_group = httpx.get(group_url, params={"timeoutMs": 0}, headers=bearer(reader_key))
        assert timed_out_group.status_code == 200, timed_out_group.text

        watch = Reader(f"{server.url}/v1/claims/watch?workerId=w1", key)
        stream = Reader(f"{server.url}/v1/events/stream", reader_key)
        assert watch.connected.wait(WAIT_S) and stream.connected.wait(WAIT_S)
        claim = Answered(
            "POST", f"{server.url}/v1/mailboxes/jobs/claims", key, json={"runId": str(run.id), "waitMs": 30_000}
        )
        group_wait = Answered("GET", group_url, reader_key, params={"timeoutMs": 30_000})
        wait_until(lambda: parked(server) == 2, what="the claim and the group wait parked", interval_s=0.1)

        server.process.send_signal(signal.SIGTERM)
        try:
            returncode = server.process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the API process did not stop by itself:\n{server.log()}")

    for answered in (claim, group_wait):
        answered.thread.join(WAIT_S)
        assert answered.error is None and answered.response is not None, answered.error
    assert claim.response.status_code == 200 and claim.response.json()["claims"] == [], claim.response.text
    assert group_wait.response.status_code == 200
    assert group_wait.response.json() == timed_out_group.json()
    for reader in (watch, stream):
        reader.thread.join(WAIT_S)
        assert not reader.thread.is_alive() and reader.error is None, reader.error  # ended, not cut
    assert [watch.next()[1]["event"], watch.frames.empty()] == ["watch.ready", True]
    assert returncode == -signal.SIGTERM  # uvicorn's own ending after a graceful stop: not killed


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
