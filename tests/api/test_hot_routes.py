"""The hot path's route table (coordination/api/hot/routes.py) answers what ``resolve()`` answers.

For every hot view's route, with several ids, the table's ``ResolverMatch`` is ``resolve()``'s
(all but ``tried``, which only a 404 page reads); for every other route of the project and for
malformed paths near the hot ones, the table answers None, and ``resolve()`` names no hot view
(or nothing). A pattern placed before a hot one that takes some of its paths keeps them.
"""

import re

import pytest
from django.urls import URLPattern, URLResolver, path, resolve, reverse
from django.urls.exceptions import NoReverseMatch, Resolver404
from django.urls.resolvers import RegexPattern

from coordination.api.hot import ENDPOINTS
from coordination.api.hot.routes import HotRoutes, url_patterns

IDS = ["abc", "0b6f5a1e-8d4f-4c1e-9a43-7c2a1d7e9f10", "task_01J8Z", "é ü", "%41", "a.b-c~d", "x" * 300]
COMPARED = ("func", "args", "kwargs", "url_name", "app_names", "namespaces", "route", "captured_kwargs")
COMPARED += ("extra_kwargs", "app_name", "namespace", "view_name", "_func_path")


def table() -> HotRoutes:
    return HotRoutes(ENDPOINTS)


def view_class(match):
    return getattr(match.func, "cls", None)


def sample_paths(pattern: URLPattern, value: str) -> str:
    names = re.findall(r"<(?:\w+:)?(\w+)>", str(pattern.pattern))
    return reverse(pattern.name, kwargs=dict.fromkeys(names, value))


def hot_patterns():
    return [chain[-1] for _, chain in url_patterns() if getattr(chain[-1].callback, "cls", None) in ENDPOINTS]


def other_patterns():
    found = []
    for _, chain in url_patterns():
        leaf = chain[-1]
        if getattr(leaf.callback, "cls", None) not in ENDPOINTS and leaf.name and "admin" not in str(chain[1].pattern):
            found.append(leaf)
    return found


def test_every_hot_view_has_a_route_in_the_table():
    assert {view_class(resolve(sample_paths(pattern, "x"))) for pattern in hot_patterns()} == set(ENDPOINTS)


@pytest.mark.parametrize("value", IDS)
def test_a_hot_route_resolves_as_resolve_does(value):
    routes = table()
    for pattern in hot_patterns():
        path_ = sample_paths(pattern, value)
        expected, got = resolve(path_), routes.match(path_)
        assert got is not None, path_
        for name in COMPARED:
            assert getattr(got, name) == getattr(expected, name), (path_, name)


@pytest.mark.parametrize("value", IDS[:3])
def test_every_other_route_is_refused(value):
    routes = table()
    for pattern in other_patterns():
        try:
            path_ = sample_paths(pattern, value)
        except NoReverseMatch:  # a route with a converter that does not take the value
            continue
        assert view_class(resolve(path_)) not in ENDPOINTS
        assert routes.match(path_) is None, path_


NEAR_MISSES = [
    "/v1/claims//complete",
    "/v1/claims/a/b/complete",
    "/v1/claims/a/complete/",
    "/v1/claims/a/completed",
    "/v1/claims/complete/x",
    "/v1/mailboxes/jobs/tasks/batch/x",
    "/v1/mailboxes//tasks",
    "/v1/mailboxes/jobs/claims/",
    "/v1/tasks/x",
    "/v1/tasks/x/result/",
    "/v1//tasks/x/result",
    "/v1/events/",
    "/v1/events/stream/",
    "/v2/claims/a/complete",
    "v1/claims/a/complete",
    "/v1/groups/g/waits",
    "/v1/barriers/b/wait/x",
    "/v1/timers/t",
]


@pytest.mark.parametrize("path_", NEAR_MISSES)
def test_paths_near_the_hot_routes_are_refused_as_resolve_refuses_them(path_):
    try:
        found = view_class(resolve(path_))
    except Resolver404:
        found = None
    assert found not in ENDPOINTS
    assert table().match(path_) is None


class Early:
    """A view placed before a hot route (its class is not hot)."""


def early_view(request, **kwargs):
    raise AssertionError("never called")


early_view.cls = Early


def test_an_earlier_pattern_that_takes_a_hot_path_keeps_it():
    """``resolve()`` takes the first pattern that matches: the table does not take a path an earlier one may."""
    hot_view = next(p for p in hot_patterns() if str(p.pattern) == "claims/<str:claim_id>/complete")
    patterns = [
        path("claims/special/complete", early_view, name="early"),
        path("unrelated/<str:x>", early_view, name="unrelated"),
        hot_view,
    ]
    resolver = URLResolver(RegexPattern(r"^/"), [URLResolver(RegexPattern(r"^v1/"), patterns)])
    routes = HotRoutes(ENDPOINTS, resolver)
    assert resolver.resolve("/v1/claims/special/complete").func is early_view
    assert routes.match("/v1/claims/special/complete") is None
    assert routes.match("/v1/claims/other/complete").func is resolver.resolve("/v1/claims/other/complete").func
    assert routes.match("/v1/claims/other/complete").kwargs == {"claim_id": "other"}
