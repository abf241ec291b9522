"""The condition table's SQL twin (``decides_sql``, in the single-statement verdict) agrees with ``decide``.

Hypothesis draws counters (members, accepted, rejected, still acceptable, finished: any
values, not only those a group can reach), a condition, a threshold and closed, and the
database evaluates the SQL: it must say "decides" exactly when ``decide`` decides without a
passed deadline (the statement runs only while no deadline passed). And the recount is the
sum of the members' shares.
"""

import pytest
from django.db import connection
from hypothesis import given, settings
from hypothesis import strategies as st

from coordination.domain.group_rules import GroupCounts, MemberFacts, decide, member_counts, recount
from coordination.domain.states import GroupCondition, TaskState, Verdict
from coordination.services.groups import decides_sql

COUNTS = st.builds(
    GroupCounts,
    members=st.integers(0, 100),
    accepted=st.integers(0, 100),
    rejected=st.integers(0, 100),
    acceptable=st.integers(0, 100),
    finished=st.integers(0, 100),
)

SQL = "SELECT " + decides_sql(
    condition="%(condition)s",
    threshold="%(threshold)s::int",
    closed="%(closed)s",
    counts={name: f"%({name})s::int" for name in ("members", "accepted", "rejected", "acceptable", "finished")},
)


@pytest.mark.postgres_only
@pytest.mark.django_db
@settings(max_examples=400, deadline=None)
@given(
    condition=st.sampled_from(list(GroupCondition.values)),
    threshold=st.integers(1, 100),
    closed=st.booleans(),
    counts=COUNTS,
)
def test_the_sql_decides_exactly_when_decide_does(condition, threshold, closed, counts):
    threshold = threshold if condition == GroupCondition.N_ACCEPTED else None
    expected = decide(condition=condition, threshold=threshold, closed=closed, counts=counts, deadline_passed=False)
    params = {"condition": condition, "threshold": threshold, "closed": closed, **counts.__dict__}
    with connection.cursor() as cursor:
        cursor.execute(SQL, params)
        (decides,) = cursor.fetchone()
    assert decides == (expected is not None)


@given(st.lists(st.builds(MemberFacts, st.sampled_from(list(TaskState)), st.sampled_from([None, *Verdict]))))
def test_the_recount_is_the_sum_of_the_members_shares(members):
    counts = recount(members)
    assert counts.members == len(members)
    assert counts.accepted == sum(m.verdict == Verdict.ACCEPTED for m in members)
    assert sum((member_counts(m) for m in members), GroupCounts()) == counts
