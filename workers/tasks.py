"""Celery tasks of runstate (the periodic sweeps and the decorated-task runtime land here)."""
