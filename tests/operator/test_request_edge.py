"""The request edge against a real uvicorn: what no key, a huge body or a crafted query string costs.

- a 64 KB query string built to make the log redaction backtrack holds no other request of
  the process (the access log is on, as in a default deployment);
- a body is checked before it is read: no valid key is a 401, a ``Content-Length`` over the
  limit a 413, both answered before any of the body is read; a chunked body stops being
  read at the limit (413).
"""

import socket
import threading
import time

import httpx
import pytest
from django.conf import settings

from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from tests.operator.live import uvicorn_server

pytestmark = pytest.mark.django_db(transaction=True)

HUGE = 400 * 1024 * 1024  # what the report sent: it became a 400 MB temporary file
CHUNK = 64 * 1024


def healthz_seconds(client: httpx.Client) -> float:
    started = time.perf_counter()
    assert client.get("/v1/healthz").status_code == 200
    return time.perf_counter() - started


def test_a_crafted_64_kib_query_string_holds_no_other_request(tmp_path):
    """Three requests whose query string made the log redaction quadratic (15 s each before).

    From the moment they are sent until the last is answered, plain health checks are sent
    one after another (at least one): none waits longer than the slowest of ten measured
    just before, in the same test, plus one second.
    """
    hostile = "/v1/healthz?" + "key" * 21_840  # 64 KB, longer than httpx sends: a raw socket does
    with uvicorn_server(tmp_path / "uvicorn", log_level="info", RUNSTATE_DB_POOL_SIZE="5") as server:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            baseline = max(healthz_seconds(client) for _ in range(10))
            finished = threading.Event()
            answers: list[int] = []

            def attack():
                answers.append(raw_request(server.url, f"GET {hostile} HTTP/1.1\r\n\r\n".encode()))

            def attacks():
                attackers = [threading.Thread(target=attack) for _ in range(3)]
                for thread in attackers:
                    thread.start()
                for thread in attackers:
                    thread.join()
                finished.set()

            attacks_thread = threading.Thread(target=attacks)
            attacks_thread.start()
            # At least one check after the attacks are sent, however fast they are answered
            # (on a busy machine all three can finish before this thread runs again), and
            # checks go on until the last attack is answered.
            waits = [healthz_seconds(client)]
            while not finished.is_set():
                waits.append(healthz_seconds(client))
            attacks_thread.join()
        log = server.log_path.read_text(errors="replace")
    assert answers == [200, 200, 200]
    assert max(waits) < baseline + 1.0, (max(waits), baseline, len(waits))
    assert "[cut: " in log, "the access log line was cut"


def raw_request(server_url: str, head: bytes, *, timeout_s: float = 300) -> int:
    """Send ``head`` (a request line and headers, ``Host`` and ``Connection: close`` added) and return the status."""
    request_line, _, rest = head.partition(b"\r\n")
    head = request_line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + rest
    with socket.create_connection(("127.0.0.1", int(server_url.rsplit(":", 1)[1])), timeout=timeout_s) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)
    return int(answer.split(b" ", 2)[1])


def counted_body(sent: list[int], size: int = HUGE):
    """Yield ``size`` bytes in chunks, counting in ``sent`` what the server has pulled so far."""
    chunk = b"x" * CHUNK
    while sent[0] < size:
        sent[0] += CHUNK
        yield chunk


def post_counted(server_url: str, path: str, headers: dict[str, str]) -> tuple[int, dict, int]:
    """POST a chunked 400 MB body; return the status, the JSON answer and the bytes the server pulled."""
    sent = [0]
    with httpx.Client(base_url=server_url, timeout=120) as client:
        try:
            response = client.post(path, content=counted_body(sent), headers=headers)
        except httpx.TransportError as error:  # the server closed without an answer
            return 0, {"transport": repr(error)}, sent[0]
    return response.status_code, response.json(), sent[0]


@pytest.fixture
def keys():
    project = project_ensure(name="edge")
    return {
        "valid": api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS)).plaintext,
        "unknown": "rs_0123456789ab_" + "s" * 43,
    }


def test_bodies_are_checked_before_they_are_read(tmp_path, keys):
    """No key, a wrong key, a declared size over the limit, a chunked body over it: each refused unread."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    # What the kernel buffers between client and server is pulled from the generator
    # without the server reading it: a few MB on loopback. "Unread" is far below 400 MB.
    unread = 64 * 1024 * 1024
    with uvicorn_server(tmp_path / "uvicorn", RUNSTATE_DB_POOL_SIZE="5") as server:
        status, answer, pulled = post_counted(server.url, "/v1/runs", {"Content-Type": "application/json"})
        assert (status, answer.get("error", {}).get("code")) == (401, "UNAUTHENTICATED"), answer
        assert pulled < unread, pulled

        bearer = {"Authorization": f"Bearer {keys['unknown']}", "Content-Type": "application/json"}
        status, answer, pulled = post_counted(server.url, "/v1/mailboxes/jobs/tasks", bearer)
        assert (status, answer.get("error", {}).get("code")) == (401, "UNAUTHENTICATED"), answer
        assert pulled < unread, pulled

        bearer = {"Authorization": f"Bearer {keys['valid']}", "Content-Type": "application/json"}
        # A synchronous view, and a long-poll (an async view, which Django's own handler reads for).
        for path in ("/v1/runs", "/v1/mailboxes/jobs/claims"):
            status, answer, pulled = post_counted(server.url, path, bearer)
            assert (status, answer.get("error", {}).get("code")) == (413, "VALIDATION_ERROR"), (path, answer)
            assert pulled < limit + unread, (path, pulled)
        status, answer, pulled = post_counted(server.url, "/v1/mailboxes/jobs/claims", {})
        assert (status, answer.get("error", {}).get("code")) == (401, "UNAUTHENTICATED"), answer
        assert pulled < unread, pulled

        # Headers only: the answer (413, the size is checked first) comes without a byte of the body.
        for headers in ("", f"Authorization: Bearer {keys['valid']}\r\n"):
            with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30) as sock:
                sock.sendall(
                    (
                        f"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
                        f"Content-Type: application/json\r\nContent-Length: {HUGE}\r\n\r\n"
                    ).encode()
                )
                head = b""
                while chunk := sock.recv(65536):  # until the server closes the connection
                    head += chunk
                head = head.decode(errors="replace")
            assert head.startswith("HTTP/1.1 413 "), head
            assert "connection: close" in head.lower() and '"VALIDATION_ERROR"' in head, head

        # Requests that need no key, and a small body with a valid key, are served as before.
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/v1/healthz").status_code == 200
            assert client.post("/v1/runs", json={"name": "fine"}, headers=bearer).status_code == 201
            no_key = client.post("/v1/runs", json={"name": "no"})
            assert no_key.status_code == 401 and no_key.headers["WWW-Authenticate"] == 'Bearer realm="runstate"'
