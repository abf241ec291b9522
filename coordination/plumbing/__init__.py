"""What carries the domain without being it: notifications, caches, tracing, logs, metrics, checks.

- ``notify``: the LISTEN hub that wakes waiters when their events commit (and feeds caches);
- ``process_cache``: per-process caches of API keys and mailboxes, dropped on change;
- ``tracing``: the service's spans and the W3C trace context a task carries;
- ``logging``: JSON log lines with the request's and the trace's ids;
- ``metrics`` and ``metrics_limits``: the Prometheus exposition, read at each scrape;
- ``checks``: Django system checks of runstate's own settings.

``notify``, ``process_cache`` and ``tracing`` sit below the models (every layer may use them);
``logging``, ``metrics`` and ``metrics_limits`` observe the services and reads, above them
(pyproject.toml, the ``layers`` contract).
"""
