"""Benchmarks for runstate (run as modules, e.g. ``python -m bench.throughput``).

Nothing here is a test: no module or function is named ``test_*``, and pytest only collects
``tests/`` (``testpaths`` in pyproject.toml). See bench/README.md.
"""
