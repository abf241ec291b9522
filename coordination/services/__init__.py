"""Every state change of runstate, each inside ``transaction.atomic()``.

Views, admin actions, Celery tasks and sweeps all call these functions; nothing changes state
in ``save()`` or in signals.

Lock order (one, everywhere; taking locks in another order is a bug):

    run chain, root first  ->  group  ->  task(s), in id order  ->  barrier / timer

* Anything that creates new work under a run first takes ``FOR KEY SHARE`` on every run of
  its chain, root first (``locking.run_chain_lock``). A cancel or complete takes
  ``FOR UPDATE`` on its run, which conflicts with those share locks: the cancel waits for
  in-flight creators to commit and then cascades over what they created, and a creator that
  comes after it waits, re-reads the run and is refused. Once a cancel commits, nothing new
  appears under it and nothing created concurrently escapes the cascade.
* Every run row lock is preceded by the run's advisory lock (shared before the share locks,
  exclusive before ``FOR UPDATE``): PostgreSQL queues those fairly, so creators arriving
  after a waiting cancel queue behind it instead of holding it off (``locking``).
* On SQLite there are no row locks; every transaction begins ``IMMEDIATE`` and so holds the
  database's single write lock from its first statement, which gives the same guarantee.
"""
