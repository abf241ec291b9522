"""The sync client, generated from ``runstate/_async`` by ``sdk/unasync.py`` (``consume.py`` aside)."""
