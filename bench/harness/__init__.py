"""What every benchmark shares: its database and environment, the servers it starts, the meters
around each timed phase, the same-run ``pgbench`` baseline and the report and ``--json`` writers.

One module per concern; the measures (``bench.throughput.*``, ``bench.groups``, ...) import
from here, never the other way round.
"""
