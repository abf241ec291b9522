"""Celery integration: runstate-aware task decorator, worker runtime, periodic sweeps."""
