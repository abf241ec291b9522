"""Probes, the OpenAPI schema and the docs page need no key."""

import jsonschema
import pytest
from rest_framework import serializers as drf

from coordination.api import serializers
from coordination.models import Event
from coordination.reads.selectors import event_cursor
from coordination.services.budgets import budget_create
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_a_key(anon):
    response = anon.get("/v1/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_database_and_broker(anon):
    response = anon.get("/v1/readyz")
    assert response.status_code == 200, response.json()
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readyz_is_503_with_an_envelope_when_the_broker_is_down(anon, monkeypatch):
    from runstate_project.celery import app

    original = app.conf.broker_url
    # Celery reads CELERY_BROKER_URL from the environment ahead of its configuration.
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    try:
        response = anon.get("/v1/readyz")
    finally:
        app.conf.broker_url = original
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["broker"] != "ok"
    assert body["error"]["code"] == "SERVICE_UNAVAILABLE"


def test_schema_lists_the_endpoints(anon):
    response = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    paths = schema["paths"]
    for path in [
        "/v1/runs",
        "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/children",
        "/v1/runs/{run_id}/cancel",
        "/v1/runs/{run_id}/complete",
        "/v1/events",
        "/v1/healthz",
        "/v1/readyz",
    ]:
        assert path in paths, path
    assert paths["/v1/runs"]["post"]["responses"]["201"]
    assert "409" in paths["/v1/runs/{run_id}/cancel"]["post"]["responses"]


def test_docs_page_is_served_without_a_cdn(anon):
    response = anon.get("/v1/docs")
    assert response.status_code == 200
    html = response.content.decode()
    assert "swagger" in html.lower()
    assert "cdn." not in html and "unpkg" not in html


def test_schema_declares_bearer_auth_and_leaves_probes_open(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/runs"]["post"]["security"] == [{"bearerAuth": []}]
    assert schema["paths"]["/v1/healthz"]["get"].get("security") in (None, [], [{}])


def test_schema_generates_without_warnings():
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("spectacular", "--validate", "--fail-on-warn", stdout=out)
    assert "/v1/groups/{group_id}/close" in out.getvalue()


def test_schema_lists_long_polls_and_every_operation_of_work_and_groups(anon):
    paths = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    for path, method in [
        ("/v1/tasks/{task_id}/result", "get"),
        ("/v1/mailboxes/{name}/claims", "post"),
        ("/v1/groups/{group_id}/wait", "get"),
        ("/v1/groups/{group_id}/members/{task_id}/accept", "post"),
        ("/v1/mailboxes/{name}/deliveries", "post"),
        ("/v1/events", "get"),
    ]:
        assert method in paths[path], path


def test_every_keyed_operation_documents_the_transport_errors(anon):
    """406, 429 and 503 can answer any keyed operation, 413 and 415 any body: the schema says so."""
    paths = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    for path, item in paths.items():
        for method, operation in item.items():
            documented = set(operation["responses"])
            if operation.get("security") == [{"bearerAuth": []}]:
                assert {"400", "401", "403", "404", "429", "503"} <= documented, (method, path)
                assert "Retry-After" in operation["responses"]["429"]["headers"]
                # The streams answer whatever the Accept header says; every JSON operation may 406.
                assert ("406" in documented) == (path not in {"/v1/events/stream", "/v1/claims/watch"}), (method, path)
            if "requestBody" in operation:
                assert {"413", "415"} <= documented, (method, path)


def test_an_accept_header_without_json_is_406_with_an_envelope(api):
    response = api.get("/v1/runs", HTTP_ACCEPT="text/html")
    assert response.status_code == 406
    assert response.json()["error"]["code"] == "NOT_ACCEPTABLE"


def test_every_payload_in_a_request_body_admits_what_its_field_admits(anon):
    """A ``PayloadField``'s schema admits null exactly when the field does, and every other JSON value.

    The schema was ``{}`` (any value, null included) while the field refused null, so a
    schema-valid submit with ``"input": null`` got a 400 (Schemathesis found it).
    """
    schemas = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["components"]["schemas"]
    values = [None, {"a": [1]}, [1, "two"], "text", 1.5, 7, True, False]
    checked = 0
    for name, serializer in vars(serializers).items():
        if not (isinstance(serializer, type) and issubclass(serializer, drf.Serializer)):
            continue
        for field_name, field in serializer().fields.items():
            if not isinstance(field, serializers.PayloadField):
                continue
            schema = schemas[f"{name}Request"]["properties"][field_name]
            for value in values:
                admitted = jsonschema.Draft4Validator(schema).is_valid(value)  # OpenAPI 3.0's dialect
                try:
                    field.run_validation(value)
                    accepted = True
                except drf.ValidationError:
                    accepted = False
                assert admitted == accepted, (name, field_name, value)
            checked += 1
    assert checked >= 7  # input (submit, batch item, member, rerun), outcome (two), error, body


def test_a_null_input_is_a_400_and_every_other_json_value_is_stored(api, project):
    mailbox_ensure(project_id=project.id, name="inputs", mode="WORK")
    run = {"id": str(run_create(project_id=project.id).id)}
    for value in [{"a": 1}, [1, 2], "text", 3, 2.5, True]:
        response = api.post("/v1/mailboxes/inputs/tasks", {"runId": run["id"], "input": value}, format="json")
        assert response.status_code == 201, response.content
        assert response.json()["input"] == value
    response = api.post("/v1/mailboxes/inputs/tasks", {"runId": run["id"], "input": None}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "VALIDATION_ERROR"


def served_schema(anon) -> dict:
    return anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


def admits(schema: dict, component: str, value) -> bool:
    """Whether the component ``component`` of the served schema admits ``value`` (OpenAPI 3.0's dialect)."""
    root = {"$ref": f"#/components/schemas/{component}", "components": schema["components"]}
    return jsonschema.Draft4Validator(root).is_valid(value)


def request_serializers() -> list[type]:
    """Every request body serializer (every ``StrictSerializer``, in any module of the API)."""
    found, pending = [], [serializers.StrictSerializer]
    while pending:
        for subclass in pending.pop().__subclasses__():
            found.append(subclass)
            pending.append(subclass)
    return found


def request_component(schema: dict, serializer: type) -> str:
    """The name of the component describing ``serializer`` as a request body (``Patched`` for a PATCH)."""
    for name in (f"{serializer.__name__}Request", f"Patched{serializer.__name__}Request"):
        if name in schema["components"]["schemas"]:
            return name
    raise AssertionError(f"no request component for {serializer.__name__}")


def accepts(serializer, data) -> bool:
    return serializer(data=data).is_valid()


def test_every_request_body_refuses_a_field_it_does_not_know_as_its_schema_says(anon):
    """Every request body's schema refuses an unknown field, as its serializer does.

    Without ``additionalProperties: false`` the schema admitted any extra field, which the
    serializer refuses with ``Unknown field.`` (Schemathesis' positive_data_acceptance found it
    on every operation with a body).
    """
    schema = served_schema(anon)
    checked = 0
    for serializer in request_serializers():
        component = request_component(schema, serializer)
        assert schema["components"]["schemas"][component]["additionalProperties"] is False, component
        for extra in ({"unknownField": 1}, {"": True}):
            assert not admits(schema, component, extra), (component, extra)
            assert not accepts(serializer, extra), (component, extra)
        checked += 1
    assert checked >= 40


def test_an_unknown_field_is_a_400_the_schema_forbids(api, project):
    run = run_create(project_id=project.id)
    body = {"runId": str(run.id), "target": 2, "extra": 1}
    response = api.post("/v1/barriers", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["details"] == {"extra": "Unknown field."}
    schema = served_schema(api)
    assert not admits(schema, "BarrierCreateInRequest", body)
    del body["extra"]
    assert admits(schema, "BarrierCreateInRequest", body)
    assert api.post("/v1/barriers", body, format="json").status_code == 201


def test_a_list_of_items_has_the_bounds_in_its_schema_that_its_serializer_checks(anon):
    """``minItems``/``maxItems`` of every ``many=True`` body field are its ``min_length``/``max_length``.

    An empty ``items`` or ``tasks`` was schema-valid and a 400.
    """
    schema = served_schema(anon)
    items = {
        serializers.ClaimsCompleteIn: {"claimId": "c"},
        serializers.ClaimsRenewIn: {"claimId": "c"},
        serializers.TaskBatchIn: {},
    }
    lists = 0
    for serializer in request_serializers():
        component = request_component(schema, serializer)
        for field_name, field in serializer().fields.items():
            if not isinstance(field, drf.ListSerializer):
                continue
            lists += 1
            item = items[serializer]
            base = {"runId": "r"} if "runId" in serializer().fields else {}
            for length in (0, field.min_length, field.max_length, field.max_length + 1):
                body = {**base, field_name: [item] * length}
                assert admits(schema, component, body) == accepts(serializer, body), (component, length)
            assert not admits(schema, component, {**base, field_name: []})
    assert lists == len(items)


def test_an_empty_batch_is_a_400_the_schema_forbids(api, project):
    mailbox_ensure(project_id=project.id, name="batches", mode="WORK")
    run = run_create(project_id=project.id)
    schema = served_schema(api)
    for path, body, component in [
        ("/v1/mailboxes/batches/tasks/batch", {"runId": str(run.id), "tasks": []}, "TaskBatchInRequest"),
        ("/v1/claims/complete", {"items": []}, "ClaimsCompleteInRequest"),
        ("/v1/claims/renew", {"items": []}, "ClaimsRenewInRequest"),
    ]:
        response = api.post(path, body, format="json")
        assert response.status_code == 400, (path, response.content)
        assert response.json()["error"]["code"] == "VALIDATION_ERROR"
        assert not admits(schema, component, body), path


def test_a_budget_patch_without_its_limit_is_a_400_the_schema_forbids(api, project):
    """A PATCH body is validated whole: its schema lists ``limit`` as required (drf-spectacular made it optional)."""
    run = run_create(project_id=project.id)
    budget = budget_create(project_id=project.id, run_id=run.id, name="tokens", limit=10)
    schema = served_schema(api)
    response = api.patch(f"/v1/budgets/{budget.id}", {}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["details"] == {"limit": "This field is required."}
    assert not admits(schema, "PatchedBudgetLimitInRequest", {})
    assert admits(schema, "PatchedBudgetLimitInRequest", {"limit": 20})
    assert api.patch(f"/v1/budgets/{budget.id}", {"limit": 20}, format="json").status_code == 200


NAMED = ["/v1/mailboxes/{name}", "/v1/pools/{name}", "/v1/quotas/{name}"]


def test_a_name_in_a_path_has_the_pattern_its_service_checks(api, project):
    """A mailbox, pool or quota name the schema admits is accepted; one it refuses is a 400 where it is created.

    ``{name}`` was any string, so ``PUT /v1/mailboxes/-x`` was schema-valid and a 400.
    """
    schema = served_schema(api)
    parameters = [
        parameter
        for path, item in schema["paths"].items()
        if path.startswith(("/v1/mailboxes/", "/v1/pools/", "/v1/quotas/"))
        for operation in item.values()
        for parameter in operation["parameters"]
        if parameter["in"] == "path"
    ]
    assert len(parameters) == 13
    assert all(parameter["schema"] == parameters[0]["schema"] for parameter in parameters)
    name_schema = parameters[0]["schema"]
    bodies = {
        "/v1/mailboxes/{name}": {"mode": "WORK"},
        "/v1/pools/{name}": {"capacity": 1},
        "/v1/quotas/{name}": {"limit": 1, "periodMs": 1000},
    }
    for name in ["a", "A.b_c-9", "x" * 100, "-a", ".a", "_a", "a b", "a:b", "é", "x" * 101]:
        admitted = jsonschema.Draft4Validator(name_schema).is_valid(name)
        for path in NAMED:
            response = api.put(path.format(name=name), bodies[path], format="json")
            assert response.status_code in ((200, 201) if admitted else (400,)), (path, name, response.content)
            if not admitted:
                assert response.json()["error"]["code"] == "VALIDATION_ERROR"


STRINGS = ["", " ", "\t\n", "\x1c", "\x85", "\u3000", "\ufeff", "a", " a ", "a\x00", "\x00", "x" * 100, "x" * 101]
# Where the schema and the field must agree exactly (elsewhere the schema may be narrower: ECMA's \s).
EXACT = ["", " ", "\t\n", "\x1c", "\x85", "a", " a ", "a\x00", "\x00", "x" * 100]


def test_every_string_of_a_request_admits_what_its_field_accepts(anon):
    """A ``CharField``'s schema refuses NUL, and a whitespace-only string where blank is not allowed.

    DRF refuses both (``Null characters are not allowed.``; it trims, then ``may not be
    blank``) while the schema said ``type: string, minLength: 1``: a ``runId`` of ``"\\u0000"``
    or ``" "`` was schema-valid and a 400.
    """
    schema = served_schema(anon)
    components = schema["components"]["schemas"]
    checked = 0
    for serializer in request_serializers():
        component = components[request_component(schema, serializer)]
        for field_name, field in serializer().fields.items():
            if not isinstance(field, drf.CharField):
                continue
            field_schema = component["properties"][field_name]
            for value in STRINGS:
                admitted = jsonschema.Draft4Validator(field_schema).is_valid(value)
                try:
                    field.run_validation(value)
                    accepted = True
                except drf.ValidationError:
                    accepted = False
                if value in EXACT or admitted:
                    assert admitted == accepted, (serializer.__name__, field_name, value)
            checked += 1
    assert checked >= 36


def test_a_nul_or_a_blank_string_is_a_400_the_schema_forbids(api, project):
    run = run_create(project_id=project.id)
    mailbox_ensure(project_id=project.id, name="strings", mode="WORK")
    schema = served_schema(api)
    cases = [
        ("/v1/barriers", {"runId": " ", "target": 2}, "BarrierCreateInRequest", "runId"),
        ("/v1/barriers", {"runId": str(run.id), "target": 2, "name": "a\x00"}, "BarrierCreateInRequest", "name"),
        ("/v1/mailboxes/strings/tasks", {"runId": str(run.id), "input": "a\x00"}, "TaskSubmitInRequest", "input"),
        ("/v1/mailboxes/strings/tasks", {"runId": str(run.id), "key": "\x00"}, "TaskSubmitInRequest", "key"),
    ]
    for path, body, component, field in cases:
        response = api.post(path, body, format="json")
        assert response.status_code == 400, (path, body, response.content)
        assert field in response.json()["error"]["details"], response.content
        assert not admits(schema, component, body), (component, body)
    for path, body, component in [
        ("/v1/barriers", {"runId": f" {run.id} ", "target": 2, "name": " "}, "BarrierCreateInRequest"),
        ("/v1/mailboxes/strings/tasks", {"runId": str(run.id), "input": "a", "key": "k"}, "TaskSubmitInRequest"),
    ]:
        assert admits(schema, component, body), (component, body)
        response = api.post(path, body, format="json")
        assert response.status_code == 201, (path, body, response.content)


def test_an_event_cursor_has_the_shape_in_its_schema_that_the_events_parse(api, project):
    """``after`` (and ``Last-Event-ID``) admit ``<txid>-<id>``: any other string was schema-valid and a 400.

    A cursor the schema admits is accepted; the strings it refuses are refused (``Malformed cursor.``),
    but for what Python's ``int`` forgives and no server ever hands out (``"1 -2"``, ``"+1-2"``).
    """
    run_create(project_id=project.id)
    cursor = event_cursor(Event.objects.filter(project_id=project.id).get())
    schema = served_schema(api)
    parameters = {
        (path, parameter["name"]): parameter["schema"]
        for path in ("/v1/events", "/v1/events/stream")
        for parameter in schema["paths"][path]["get"]["parameters"]
    }
    after = parameters[("/v1/events", "after")]
    assert parameters[("/v1/events/stream", "after")] == after
    last_event_id = parameters[("/v1/events/stream", "Last-Event-ID")]
    for value in ["1 -2", "+1-2", "1_0-2"]:
        assert not jsonschema.Draft4Validator(after).is_valid(value), value
    for value in [cursor, "0-0", "", "123456789012345678-1", "abc", "1", "1-", "-1", "1-2-3", "1-x", "1-2\n"]:
        admitted = jsonschema.Draft4Validator(after).is_valid(value)
        assert jsonschema.Draft4Validator(last_event_id).is_valid(value) == admitted, value
        response = api.get("/v1/events", {"after": value})
        if admitted:
            assert response.status_code == 200, (value, response.content)
        else:
            assert response.status_code == 400, (value, response.content)
            assert response.json()["error"]["details"] == {"after": "malformed"}
    assert jsonschema.Draft4Validator(after).is_valid(cursor)
