# Generated from runstate/_async/groups.py by sdk/unasync.py: edit that file, then regenerate.
"""Task groups: ``run.groups.create`` / ``by_id`` and the group handle."""

from datetime import datetime
from typing import Any

from runstate._config import JsonDict, compact, segment, wire_time
from runstate._sync.http import Http
from runstate._sync.work import Ticket
from runstate._tracing import annotate_task, send_span


class Group:
    """A handle on a task group; ``data`` is the group as last seen (``None`` until loaded)."""

    def __init__(self, http: Http, group_id: str, data: JsonDict | None = None) -> None:
        self._http = http
        self.id = group_id
        self.data = data

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"

    @property
    def _path(self) -> str:
        return f"/groups/{segment(self.id)}"

    def status(self) -> JsonDict:
        """Return the group with every member (``scopeId`` is the run its workers attach to)."""
        self.data = self._http.request("GET", self._path, idempotent=True)
        return self.data

    def submit(self, input: Any = None, *, key: str | None = None) -> Ticket:
        """Add a member task and return its ticket (``ticket.data["groupState"]`` tells if it closed the group).

        With ``key`` the submit is idempotent (and retried); without one it is sent once.
        """
        body = compact(key=key) | {"input": {} if input is None else input}
        mailbox = (self.data or {}).get("mailbox") or f"group {self.id}"
        with send_span(mailbox, run_id=(self.data or {}).get("scopeId")) as headers:
            task: JsonDict = self._http.request(
                "POST", f"{self._path}/members", idempotent=key is not None, json=body, headers=headers
            )
            annotate_task(task)
        return Ticket(self._http, task["id"], task)

    def join_task(self, task_id: str) -> JsonDict:
        """Add an existing task of the same mailbox while the group is open; answer the task and ``groupState``."""
        task: JsonDict = self._http.request("POST", f"{self._path}/join", idempotent=True, json={"taskId": task_id})
        return task

    def close(self) -> JsonDict:
        """Close the group to new members and evaluate it: ``{state, outcome, outcomeReason}`` (idempotent)."""
        decision: JsonDict = self._http.request("POST", f"{self._path}/close", idempotent=True)
        return decision

    def seal(self) -> JsonDict:
        """Close the group like ``close()``, but ``ConflictError`` ``GROUP_FINALIZED`` on a finalized group."""
        decision: JsonDict = self._http.request("POST", f"{self._path}/seal", idempotent=True)
        return decision

    def accept(self, task_id: str) -> JsonDict:
        """Accept a succeeded member: ``{taskId, verdict, late, groupState, outcome, outcomeReason}``."""
        verdict: JsonDict = self._http.request(
            "POST", f"{self._path}/members/{segment(task_id)}/accept", idempotent=True
        )
        return verdict

    def reject(self, task_id: str) -> JsonDict:
        """Reject a finished member: ``{taskId, verdict, late, groupState, outcome, outcomeReason}``."""
        verdict: JsonDict = self._http.request(
            "POST", f"{self._path}/members/{segment(task_id)}/reject", idempotent=True
        )
        return verdict

    def wait(self, timeout_ms: int | None = 60_000) -> JsonDict:
        """Wait until the group is ``FINALIZED`` and return it; ``TimeoutError`` after ``timeout_ms``."""
        self.data = self._http.wait(
            "GET",
            f"{self._path}/wait",
            done=lambda group: group.get("state") == "FINALIZED",
            timeout_ms=timeout_ms,
            what=f"Group {self.id}",
        )
        return self.data


class Groups:
    """``run.groups`` / ``rs.groups``: create groups and re-attach to them."""

    def __init__(self, http: Http) -> None:
        self._http = http

    def by_id(self, group_id: str) -> Group:
        """Return a handle on the group (no request)."""
        return Group(self._http, group_id)

    def create(
        self,
        *,
        mailbox: str,
        condition: str,
        threshold: int | None = None,
        expected_members: int | None = None,
        deadline: datetime | str | None = None,
        parent_scope_id: str | None = None,
        name: str | None = None,
    ) -> Group:
        """Create a group delivering its members through the WORK ``mailbox``.

        ``condition`` is ``FIRST_ACCEPTED``, ``N_ACCEPTED`` (with ``threshold``) or
        ``ALL_TERMINAL``. The group's own run (the gate) is a child of ``parent_scope_id``
        when given, else a root run. Never retried (two creates make two groups).
        """
        body = compact(
            mailbox=mailbox,
            condition=condition,
            threshold=threshold,
            expectedMembers=expected_members,
            deadline=wire_time(deadline),
            parentScopeId=parent_scope_id,
            name=name,
        )
        group: JsonDict = self._http.request("POST", "/groups", idempotent=False, json=body)
        return Group(self._http, group["id"], group)
