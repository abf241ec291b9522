"""The hot endpoints' routes: Django's own URL patterns, matched without scanning every other one.

``resolve()`` tries the project's URL patterns one by one in Python (about 40 µs for a claim's
path, a twentieth of the hot path's CPU per request). ``HotRoutes`` is built once per URL
resolver from the same patterns (``url_patterns``, which ``runstate_project.asgi.routes``
walks too): for each pattern of a hot view, its full-path regex, the patterns before it that
a path it matches could also match (``_may_overlap``: both anchored, their literal beginnings
agree), and its chain of resolvers. A path is the hot route's when its regex matches and none
of those earlier patterns does; the ``ResolverMatch`` is then made as ``URLResolver.resolve``
makes it, by the same patterns' ``match`` and ``resolve`` along the chain, without trying
their siblings (``tried`` stays empty: Django reads it only to list the patterns a 404 tried).

Anything else (no hot pattern matches, an earlier pattern might, a converter refuses the
value) is ``None``: the request goes to ``resolve()`` on the DRF path, as before.
``tests/api/test_hot_routes.py`` compares it with ``resolve()`` for every hot route and for
paths that are not hot.
"""

import re
from collections.abc import Iterator

from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import ResolverMatch

# Everything up to the first of these in a regex is a literal its matches all begin with.
_SPECIAL = re.compile(r"[\\.^$*+?{}\[\]|()]")


def url_patterns(resolver: URLResolver | None = None, prefix: str = "^/", chain: tuple = ()) -> Iterator[tuple]:
    """Yield ``(full path regex, resolvers down to the pattern)`` for every URL pattern, in Django's order."""
    resolver = resolver or get_resolver()
    chain = (*chain, resolver)
    for pattern in resolver.url_patterns:
        regex = prefix + pattern.pattern.regex.pattern.removeprefix("^")
        if isinstance(pattern, URLResolver):
            yield from url_patterns(pattern, regex, chain)
        else:
            yield regex, (*chain, pattern)


def _literal_start(regex: str) -> str:
    body = regex.removeprefix("^")
    special = _SPECIAL.search(body)
    return body if special is None else body[: special.start()]


def _may_overlap(regex: str, other: str) -> bool:
    """Tell whether a path might match both anchored regexes (False only when their literal beginnings differ)."""
    mine, theirs = _literal_start(regex), _literal_start(other)
    return mine.startswith(theirs) or theirs.startswith(mine)


class _Route:
    """One hot pattern: its regex, the earlier patterns that may take its paths, and what its match holds."""

    def __init__(self, regex: str, shadows: list[str], chain: tuple) -> None:
        self.regex = re.compile(regex)
        self.shadow = re.compile("|".join(f"(?:{other})" for other in shadows)) if shadows else None
        *self.resolvers, self.pattern = chain
        # What ``URLResolver.resolve`` adds at each level on the way up, the same for every path.
        self.app_names = [resolver.app_name for resolver in self.resolvers]
        self.namespaces = [resolver.namespace for resolver in self.resolvers]
        self.route, self.extra_kwargs, below = str(self.pattern.pattern), dict(self.pattern.default_args), self.pattern
        for resolver in reversed(self.resolvers):
            above = "" if isinstance(below, URLPattern) else str(below.pattern)
            self.route = resolver._join_route(above, self.route)
            self.extra_kwargs = {**resolver.default_kwargs, **self.extra_kwargs}
            below = resolver

    def resolve(self, path: str) -> ResolverMatch | None:
        """``URLResolver.resolve`` down this route only: each level's ``match``, merged as Django merges them."""
        levels = []
        for resolver in self.resolvers:
            matched = resolver.pattern.match(path)
            if not matched:
                return None
            path, args, kwargs = matched
            levels.append((resolver, args, kwargs))
        matched = self.pattern.pattern.match(path)  # what ``URLPattern.resolve`` matches, converters applied
        if not matched:
            return None
        _, args, captured = matched
        kwargs = {**captured, **self.pattern.default_args}
        for resolver, level_args, level_kwargs in reversed(levels):
            merged = {**level_kwargs, **resolver.default_kwargs}
            merged.update(kwargs)
            args = args if merged else level_args + args
            kwargs = merged
        return ResolverMatch(
            self.pattern.callback,
            args,
            kwargs,
            self.pattern.pattern.name,
            self.app_names,
            self.namespaces,
            self.route,
            [],
            captured_kwargs=captured,
            extra_kwargs=dict(self.extra_kwargs),
        )


class HotRoutes:
    """The routes of ``views`` (view classes) in ``resolver``, matched as ``resolve()`` would."""

    def __init__(self, views, resolver: URLResolver | None = None) -> None:
        self._routes: list[_Route] = []
        earlier: list[str] = []
        for regex, chain in url_patterns(resolver):
            if getattr(chain[-1].callback, "cls", None) in views:
                shadows = [re.sub(r"\(\?P<\w+>", "(?:", other) for other in earlier if _may_overlap(regex, other)]
                self._routes.append(_Route(regex, shadows, chain))
            earlier.append(regex)

    def match(self, path: str) -> ResolverMatch | None:
        """Return what ``resolve(path)`` returns if that is a route of the views, else None."""
        for route in self._routes:
            if route.regex.match(path):
                if route.shadow is not None and route.shadow.match(path):
                    return None  # an earlier pattern may take it: resolve() decides
                return route.resolve(path)
        return None
