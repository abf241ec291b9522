"""``plain_body`` agrees with the serializers it stands in for (coordination/api/bodies.py).

For every request serializer of the API, and bodies drawn from the values that trip fields
up (blanks, padding, NUL, numbers as strings, booleans as numbers, out-of-range values,
unknown and missing fields): whenever ``plain_body`` answers, its answer is exactly the
serializer's ``validated_data``, and it never answers a body the serializer refuses.
"""

import datetime as dt

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework import serializers

from coordination.api import serializers as s
from coordination.api.bodies import _UNSUPPORTED, _fields, plain_body

REQUEST_SERIALIZERS = sorted(
    (
        klass
        for klass in vars(s).values()
        if isinstance(klass, type) and issubclass(klass, s.StrictSerializer) and klass is not s.StrictSerializer
    ),
    key=lambda klass: klass.__name__,
)
HOT = [s.TaskSubmitIn, s.ClaimIn, s.CompleteIn, s.RenewIn, s.FailIn, s.ClaimsCompleteIn, s.ClaimsRenewIn, s.TaskBatchIn]

tricky = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-2_000_000, max_value=100_000_000),
    st.sampled_from([0, 1, 99, 100, 101, 1000, 1001, -1, 86_400_000, 86_400_001, 1.0, 1.5, float("nan")]),
    st.sampled_from(["", " ", "k", " k ", "k\x00", "\ud800", "1", "1.0", "true", "x" * 300, "2026-12-01T00:00:00Z"]),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.builds(lambda depth: _nested(depth), st.integers(min_value=0, max_value=40)),
)


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def bodies(klass) -> st.SearchStrategy:
    fields = klass().fields
    names = list(fields) + ["unknown"]
    # A list of serializers (a batch's items) gets lists of its child's bodies as well.
    lists = {
        name: tricky | st.lists(bodies(type(field.child)), max_size=3)
        for name, field in fields.items()
        if isinstance(field, serializers.ListSerializer)
    }
    return st.one_of(
        st.dictionaries(st.sampled_from(names), tricky, max_size=len(names)),
        st.fixed_dictionaries({}, optional={name: lists.get(name, tricky) for name in names}),
        st.sampled_from([None, [], "text", 1]),
    )


def serializer_answer(klass, data):
    serializer = klass(data=data)
    return serializer.validated_data if serializer.is_valid() else None


@pytest.mark.parametrize("klass", REQUEST_SERIALIZERS, ids=lambda k: k.__name__)
def test_plain_body_never_disagrees_with_the_serializer(klass):
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies(klass))
    def check(data):
        plain = plain_body(klass, data)
        if plain is not None:
            assert plain == serializer_answer(klass, data), data

    check()


@pytest.mark.parametrize("klass", HOT, ids=lambda k: k.__name__)
def test_the_hot_bodies_take_the_plain_path(klass):
    assert _fields(klass) is not _UNSUPPORTED


@pytest.mark.parametrize(
    ("klass", "data"),
    [
        (s.TaskSubmitIn, {"runId": "r", "input": {"a": [1, 2]}}),
        (s.TaskSubmitIn, {"runId": "r", "input": 1, "key": "k", "priority": 5, "maxAttempts": 3}),
        (s.TaskSubmitIn, {"runId": "r", "expiresAt": "2030-01-01T00:00:00Z"}),
        (s.ClaimIn, {"runId": "r", "max": 10, "workerId": "w", "waitMs": 0}),
        (s.CompleteIn, {"outcome": {"ok": True}}),
        (s.CompleteIn, {}),
        (s.RenewIn, {"leaseTtlMs": 1000}),
        (s.FailIn, {"error": {"code": "E"}, "retry": True, "retryDelayMs": 10}),
        (s.ClaimsCompleteIn, {"items": [{"claimId": "c1", "outcome": {"ok": 1}}, {"claimId": "c2"}]}),
        (s.ClaimsRenewIn, {"items": [{"claimId": "c1", "leaseTtlMs": 1000}, {"claimId": "c2", "leaseTtlMs": None}]}),
        (s.TaskBatchIn, {"runId": "r", "tasks": [{"input": 1, "key": "k"}, {"priority": 2, "maxAttempts": 3}]}),
    ],
)
def test_a_plain_body_is_answered_as_the_serializer_answers(klass, data):
    plain = plain_body(klass, data)
    assert plain is not None
    assert plain == serializer_answer(klass, data)


@pytest.mark.parametrize(
    ("klass", "data"),
    [
        (s.TaskSubmitIn, {"input": {}}),  # runId missing
        (s.TaskSubmitIn, {"runId": "r", "nope": 1}),
        (s.TaskSubmitIn, {"runId": "r", "priority": "x"}),
        (s.ClaimIn, {"runId": "r", "max": 101}),
        (s.CompleteIn, {"outcome": "\x00"}),
        (s.CompleteIn, {"outcome": _nested(40)}),
        (s.CompleteIn, ["outcome"]),
        (s.ClaimsCompleteIn, {"items": []}),
        (s.ClaimsCompleteIn, {"items": {"claimId": "c"}}),
        (s.ClaimsCompleteIn, {"items": [{"claimId": 1}]}),
        (s.ClaimsCompleteIn, {"items": [{"claimId": "c", "bogus": 1}]}),
        (s.ClaimsCompleteIn, {"items": [{"claimId": "c"}] * 501}),
        (s.ClaimsRenewIn, {"items": [{"claimId": "c", "leaseTtlMs": 5}]}),
        (s.TaskBatchIn, {"runId": "r", "tasks": [{"maxAttempts": 0}]}),
        (s.TaskBatchIn, {"runId": "r"}),
    ],
)
def test_a_body_the_serializer_refuses_is_left_to_it(klass, data):
    assert serializer_answer(klass, data) is None
    assert plain_body(klass, data) is None


def test_a_serializer_with_checks_of_its_own_is_left_to_itself():
    class Checked(s.StrictSerializer):
        a = serializers.IntegerField()

        def validate(self, attrs):
            raise serializers.ValidationError("never")

    class Nested(s.StrictSerializer):
        inner = s.CompleteIn()

    assert plain_body(Checked, {"a": 1}) is None
    assert plain_body(Nested, {"inner": {}}) is None


def test_a_datetime_comes_back_as_the_serializer_gives_it():
    data = {"runId": "r", "expiresAt": "2030-01-01T00:00:00+02:00"}
    plain = plain_body(s.TaskSubmitIn, data)
    assert plain["expiresAt"] == dt.datetime(2029, 12, 31, 22, 0, tzinfo=dt.UTC)
    assert plain == serializer_answer(s.TaskSubmitIn, data)
