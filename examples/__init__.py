"""Example applications built on runstate (run each with ``python -m examples.<name>``)."""
