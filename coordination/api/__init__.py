"""The HTTP API (``/v1``): thin DRF views over the services and selectors."""
