"""The async client: the source the sync client is generated from (see ``sdk/unasync.py``)."""
