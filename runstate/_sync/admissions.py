# Generated from runstate/_async/admissions.py by sdk/unasync.py: edit that file, then regenerate.
"""Admissions: ``run.admissions`` (room for at most ``maxActive`` child runs at once) and their handles.

An admitted child run is answered as a run handle, which the runs module makes: it hands its
own constructor in (``open_run``), as it holds ``run.admissions``, so this module needs
nothing of it and ``RunHandle`` is whatever that constructor returns (``Scope``).
"""

import uuid
from collections.abc import Callable
from datetime import datetime
from time import monotonic

from runstate._config import MAX_SERVER_WAIT_MS, JsonDict, compact, segment, wire_time
from runstate._sync.http import Http

type OpenRun[RunHandle] = Callable[[Http, str, JsonDict], RunHandle]


class Admission[RunHandle]:
    """A handle on an admission; ``data`` is the admission as last seen.

    ``state`` is ``WAITING``, ``ADMITTED``, ``WITHDRAWN`` or ``CANCELLED``; ``position`` the
    place in line while waiting (from 1); ``run`` a handle on the admitted child run.
    """

    def __init__(
        self,
        http: Http,
        admission_id: str,
        data: JsonDict | None = None,
        *,
        open_run: OpenRun[RunHandle],
        parent_id: str | None = None,
        key: str | None = None,
    ) -> None:
        self._http = http
        self._open_run = open_run
        self.id = admission_id
        self.data = data
        self._parent_id = parent_id or (data or {}).get("parentRunId")
        self.key = key or (data or {}).get("key")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.state}>"

    @property
    def state(self) -> str | None:
        """Return the state as last seen (``None`` until loaded)."""
        return (self.data or {}).get("state")

    @property
    def position(self) -> int | None:
        """Return the place in line as last seen (1 is next), ``None`` unless waiting."""
        return (self.data or {}).get("position")

    @property
    def run(self) -> RunHandle | None:
        """Return a handle on the admitted child run, ``None`` until admitted."""
        run = (self.data or {}).get("run")
        return self._open_run(self._http, run["id"], run) if run else None

    def status(self) -> JsonDict:
        """Return the admission (``GET /admissions/{id}``)."""
        self.data = self._http.request("GET", f"/admissions/{segment(self.id)}", idempotent=True)
        self._parent_id = self.data.get("parentRunId")
        self.key = self.data.get("key")
        return self.data

    def wait(self, wait_ms: int | None = 30_000) -> "Admission[RunHandle]":
        """Wait in line until admitted, at most ``wait_ms`` (``None``: no limit); return this admission.

        Still waiting after ``wait_ms``: ``state`` stays ``WAITING`` (the request keeps its
        place). Raise the run's refusal (``ScopeCancelledError``...) if the parent ends
        meanwhile. Re-polls the request with its key (a long-poll); without one, reads it.
        """
        if wait_ms is not None and wait_ms < 0:
            raise ValueError("wait_ms must be >= 0")
        if self.key is None or self._parent_id is None:
            self.status()
        if self.key is None or self._parent_id is None:
            return self  # made elsewhere without a key: one read is all we can do
        deadline = None if wait_ms is None else monotonic() + wait_ms / 1000
        while True:
            remaining = MAX_SERVER_WAIT_MS if deadline is None else max(0, int((deadline - monotonic()) * 1000))
            chunk_ms = min(remaining, MAX_SERVER_WAIT_MS)
            self.data = self._http.request(
                "POST",
                f"/runs/{segment(self._parent_id)}/admissions",
                idempotent=True,  # the key makes a repeat find the same admission
                json={"key": self.key, "waitMs": chunk_ms},
                wait_ms=chunk_ms,
            )
            if self.state != "WAITING" or (deadline is not None and monotonic() >= deadline):
                return self

    def withdraw(self) -> JsonDict:
        """Leave the line (``WITHDRAWN``); ``ConflictError`` ``INVALID_STATE`` once admitted."""
        self.data = self._http.request("POST", f"/admissions/{segment(self.id)}/withdraw", idempotent=True)
        return self.data


class Admissions[RunHandle]:
    """``run.admissions``: ask for room for a child run of this run, and set the limit."""

    def __init__(self, http: Http, run_id: str, open_run: OpenRun[RunHandle]) -> None:
        self._http = http
        self._run_id = run_id
        self._open_run = open_run

    @property
    def _path(self) -> str:
        return f"/runs/{segment(self._run_id)}"

    def get(self, admission_id: str) -> Admission[RunHandle]:
        """Return a handle on the admission (no request)."""
        return Admission(self._http, admission_id, open_run=self._open_run, parent_id=self._run_id)

    def configure(self, *, max_active: int) -> JsonDict:
        """Let at most ``max_active`` admitted children of the run be active at once (needs ``resource_config``)."""
        config: JsonDict = self._http.request(
            "PUT", f"{self._path}/admission", idempotent=True, json={"maxActive": max_active}
        )
        return config

    def status(self) -> JsonDict:
        """Return the run's limit and use: ``{runId, maxActive, admitted, waiting}``."""
        config: JsonDict = self._http.request("GET", f"{self._path}/admission", idempotent=True)
        return config

    def request(
        self,
        *,
        name: str | None = None,
        key: str | None = None,
        wait_ms: int = 0,
        deadline: datetime | str | None = None,
    ) -> Admission[RunHandle]:
        """Ask for a child run: admitted at once when there is room and nobody waits, else in line.

        With ``wait_ms`` wait up to that long in line (longer waits loop over the server's
        30 s cap). The answer's ``state`` says which; ``run`` is the new child once admitted.
        Without a ``key`` one is made up, so a retry or ``wait()`` finds the same admission.
        Raise the run's refusal (``ScopeCancelledError``...) under an inactive run.
        """
        key = key if key is not None else f"sdk-{uuid.uuid4().hex}"
        chunk_ms = min(max(wait_ms, 0), MAX_SERVER_WAIT_MS)
        data: JsonDict = self._http.request(
            "POST",
            f"{self._path}/admissions",
            idempotent=True,  # the key makes a repeat find the same admission
            json=compact(name=name, key=key, waitMs=chunk_ms, deadline=wire_time(deadline)),
            wait_ms=chunk_ms,
        )
        admission = Admission(
            self._http, data["admissionId"], data, open_run=self._open_run, parent_id=self._run_id, key=key
        )
        if admission.state == "WAITING" and wait_ms > chunk_ms:
            admission.wait(wait_ms - chunk_ms)
        return admission
