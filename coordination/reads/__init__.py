"""Reads for the edges (API, admin, dashboard, metrics): queries that change nothing.

- ``selectors``: the objects and lists the API answers with, kept to a project;
- ``project_scope``: which projects a staff user may see, and querysets kept to them;
- ``stuck_cancellations``: cancels left unfinished longer than their lease TTL, and why.

Above the services (a read applies a service's rule, e.g. ``locking.chain_refusal``), below
every edge; no service reads through them.
"""
