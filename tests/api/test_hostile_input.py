"""Hostile or malformed input answers a 4xx with an error code, never a 500."""

import base64
import json
import re

import pytest
from asgiref.sync import async_to_sync

pytestmark = pytest.mark.django_db


def code(response):
    return response.json()["error"]["code"]


def test_oversized_body_is_413_with_an_envelope(api):
    response = api.post("/v1/runs", data='{"name": "' + "x" * 3_000_000 + '"}', content_type="application/json")
    assert response.status_code == 413 and code(response) == "VALIDATION_ERROR"


def test_deeply_nested_json_is_400(api):
    response = api.post("/v1/runs", data="[" * 100_000 + "]" * 100_000, content_type="application/json")
    assert response.status_code == 400 and code(response) == "VALIDATION_ERROR"


def test_wrong_content_type_is_a_4xx_with_a_code(api):
    response = api.post("/v1/runs", data="{}", content_type="text/plain")
    assert response.status_code == 415 and code(response) == "UNSUPPORTED_MEDIA_TYPE"


@pytest.mark.parametrize("debug", [True, False])
@pytest.mark.parametrize("path", ["/v1/nope", "/v1/runs/x/y/z", "/v1/", "/v1"])
def test_an_unknown_api_path_answers_the_json_envelope_whatever_debug_says(api, settings, debug, path):
    """Django's own 404 page (HTML, and under DEBUG a list of every route) never answers under /v1."""
    settings.DEBUG = debug
    for method in (api.get, api.post, api.delete):
        response = method(path)
        assert response.status_code == 404, (path, response.content[:200])
        assert response["Content-Type"] == "application/json"
        assert code(response) == "NOT_FOUND"


@pytest.mark.parametrize(
    "body",
    [
        {"childLimit": 10**30},
        {"childLimit": -(10**30)},
        {"name": "\u0000\ud7ff😀"},
        {"deadline": "9999-99-99T99:99:99Z"},
        {"parentId": "../../etc/passwd"},
        {"parentId": {"nested": ["object"]}},
        {"name": ["not", "a", "string"]},
    ],
)
def test_odd_values_are_4xx(api, body):
    response = api.post("/v1/runs", body, format="json")
    assert 400 <= response.status_code < 500, response.content
    assert code(response) in ("VALIDATION_ERROR", "NOT_FOUND")


@pytest.mark.parametrize(
    "path",
    ["/v1/runs/%00", "/v1/tasks/' OR 1=1 --", "/v1/groups/" + "a" * 5000, "/v1/claims/c_" + "f" * 32 + "_x/complete"],
)
def test_ids_of_the_wrong_shape_are_404(api, path):
    response = api.post(path, {}, format="json") if path.endswith("complete") else api.get(path)
    assert response.status_code == 404 and code(response) == "NOT_FOUND"


@pytest.fixture
def work(api):
    api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json")
    return api.post("/v1/runs", {}, format="json").json()


def nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("payload", [{"a": "x\u0000y"}, {"a\u0000": 1}, ["\u0000"], {"deep": nested(40)}])
def test_payloads_that_the_database_or_the_limits_refuse_are_400(api, work, payload):
    response = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": payload}, format="json")
    assert response.status_code == 400 and code(response) == "VALIDATION_ERROR"
    assert "input" in response.json()["error"]["details"]


def test_a_payload_over_256_kib_is_400(api, work):
    response = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": {"x": "y" * 300_000}}, format="json")
    assert response.status_code == 400 and "input" in response.json()["error"]["details"]


def test_unicode_payloads_round_trip(api, work):
    payload = {"ключ": "значение 😀", "emoji": ["🧪", "\u2028"], "n": -(2**53)}
    response = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "input": payload}, format="json")
    assert response.status_code == 201 and response.json()["input"] == payload


@pytest.mark.parametrize("name", ["%00", "a%00b", "x" * 3000, "jobs%0A", "jobs%0D%0A"])
def test_a_mailbox_name_no_mailbox_can_have_is_404_on_every_mailbox_operation(api, work, name):
    """A NUL in the path's mailbox name reached PostgreSQL, which refused it: a 500."""
    run_id = work["id"]
    for method, suffix, body in [
        ("get", "", None),
        ("post", "/tasks", {"runId": run_id}),
        ("post", "/claims", {"runId": run_id}),
        ("post", "/messages", {"runId": run_id, "body": {}}),
        ("post", "/deliveries", {"runId": run_id}),
    ]:
        response = getattr(api, method)(f"/v1/mailboxes/{name}{suffix}", body, format="json")
        assert response.status_code == 404 and code(response) == "NOT_FOUND", (suffix, response.content)
    response = api.put(f"/v1/mailboxes/{name}", {"mode": "WORK"}, format="json")
    assert response.status_code == 400 and code(response) == "VALIDATION_ERROR"


# (method, path, body, the field): a value of another JSON type than the schema names.
WRONG_JSON_TYPES = [
    ("post", "/v1/runs", {"name": 5}, "name"),
    ("post", "/v1/mailboxes/jobs/tasks", {"runId": "{run}", "key": 5}, "key"),
    ("post", "/v1/mailboxes/jobs/tasks", {"runId": "{run}", "priority": "3"}, "priority"),
    ("post", "/v1/mailboxes/jobs/tasks", {"runId": "{run}", "priority": True}, "priority"),
    ("post", "/v1/mailboxes/jobs/tasks", {"runId": "{run}", "priority": 3.5}, "priority"),
    ("post", "/v1/mailboxes/jobs/claims", {"runId": "{run}", "workerId": 7}, "workerId"),
    ("post", "/v1/mailboxes/jobs/claims", {"runId": "{run}", "max": "2"}, "max"),
    ("put", "/v1/mailboxes/jobs", {"mode": "WORK", "leaseTtlMs": "1000"}, "leaseTtlMs"),
    ("put", "/v1/quotas/q", {"limit": "5", "periodMs": 1000}, "limit"),
    ("post", "/v1/timers", {"runId": "{run}", "afterSeconds": "5"}, "afterSeconds"),
    ("post", "/v1/runs/{run}/cancel", {"reason": 1}, "reason"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), WRONG_JSON_TYPES)
def test_a_value_of_another_json_type_is_refused_not_converted(api, work, method, path, body, field):
    """DRF's fields converted them: ``5`` became the key ``"5"``, ``"3"`` the priority 3."""
    run = work["id"]
    body = {name: value.format(run=run) if isinstance(value, str) else value for name, value in body.items()}
    response = getattr(api, method)(path.format(run=run), body, format="json")
    assert response.status_code == 400 and code(response) == "VALIDATION_ERROR", response.content
    assert field in response.json()["error"]["details"], response.content


def test_a_json_integer_written_with_a_fraction_of_zero_is_an_integer(api, work):
    response = api.post("/v1/mailboxes/jobs/tasks", {"runId": work["id"], "priority": 3.0}, format="json")
    assert response.status_code == 201 and response.json()["priority"] == 3, response.content


HOSTILE_PATH_VALUES = ["%00", "%FF%FE", "%ED%A0%80", "..", "%20", "x" * 3000, "%F0%9F%98%80" * 50]


@pytest.mark.django_db(transaction=True)  # long-polls open connections of their own
def test_hostile_values_in_every_path_parameter_are_4xx(api, anon):
    api.raise_request_exception = False
    paths = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    failures = []
    for path, item in paths.items():
        for method, value in [(m, v) for m in item for v in HOSTILE_PATH_VALUES if "{" in path]:
            url = re.sub(r"\{[^}]+\}", value, path)
            response = api.get(url) if method == "get" else getattr(api, method)(url, {}, format="json")
            if not 400 <= response.status_code < 500:
                failures.append((method, path, value[:12], response.status_code))
    assert not failures


def page_cursor(created_at: str) -> str:
    raw = json.dumps([created_at, "00000000-0000-0000-0000-000000000000"]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    "path",
    [
        "/v1/runs?cursor=" + page_cursor("2020-01-01T00:00:00+99:00"),  # an offset of 99 hours: a 500 before
        "/v1/runs?cursor=" + page_cursor("2020-13-01T00:00:00Z"),
        "/v1/events?after=99999999999999999999-1",  # past bigint
        "/v1/events?after=1-99999999999999999999",
    ],
)
def test_a_crafted_cursor_is_a_validation_error(api, path):
    response = api.get(path)
    assert response.status_code == 400 and code(response) == "VALIDATION_ERROR", response.content


@pytest.mark.django_db(transaction=True)
def test_a_static_path_out_of_the_static_root_is_404():
    """``/static/../../etc/passwd`` was refused by the storage, but unhandled: a 500."""
    from asgiref.testing import ApplicationCommunicator

    from runstate_project.asgi import application
    from tests.operator.live import asgi_http_scope

    async def status_of(path: str) -> int:
        communicator = ApplicationCommunicator(application, asgi_http_scope(path))
        await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        start = await communicator.receive_output(10)
        await communicator.wait(10)
        return start["status"]

    for path in ("/static/../../etc/passwd", "/static/..%2f..%2fetc/passwd", "/static/admin/../../../settings.py"):
        assert async_to_sync(status_of)(path) == 404, path
    assert async_to_sync(status_of)("/static/admin/css/base.css") == 200
