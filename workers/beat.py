"""The scheduler beat runs: django-celery-beat's, which a database error never stops.

django-celery-beat guards most of its reads and writes against database errors, but not the
read of the whole schedule (``all_as_schedule``), which it does when beat starts, when the
schedule changed (an operator edited a periodic task) and every 5 minutes anyway. A
database that fails at that moment — a restart, a failover, a pooler pointed elsewhere —
raises out of the scheduler's construction or out of ``Scheduler.tick``, and beat exits: no
lease, deadline or timer sweep runs again until a supervisor restarts it, and without one
never. Here a tick that meets a database error closes the connection, says so, and tries
again a second later; the next tick that reaches the database reads the whole schedule
again, so a change seen just before the error is not lost and the entries' run times are
the database's. A start that meets one does the same: it reads the schedule again a second
later, until the database answers.
"""

import datetime
import logging
import time

from django import db
from django_celery_beat import schedulers

logger = logging.getLogger("runstate.beat")

# After a tick that met a database error, the next one comes this much later: the sweeps run
# every second, so beat is back within a second of the database.
RETRY_AFTER_S = 1.0


class DatabaseScheduler(schedulers.DatabaseScheduler):
    """django-celery-beat's ``DatabaseScheduler`` whose start and ticks outlive any database error."""

    def setup_schedule(self) -> None:
        """Read (and write) the schedule as beat starts; after a database error, again a second later."""
        while True:
            try:
                return super().setup_schedule()
            except db.Error as error:
                logger.warning(
                    "beat: the database failed as beat read its schedule (%r); trying again in %s s",
                    error,
                    RETRY_AFTER_S,
                )
                db.connection.close()
                self._initial_read = True  # the next try reads the whole schedule, as the first did
                time.sleep(RETRY_AFTER_S)

    def tick(self, *args, **kwargs) -> float:
        try:
            return super().tick(*args, **kwargs)
        except db.Error as error:  # Django's: OperationalError, InterfaceError, InternalError...
            logger.warning("beat: the database failed a tick (%r); trying again in %s s", error, RETRY_AFTER_S)
            db.connection.close()
            self._read_everything_at_next_tick()
            return RETRY_AFTER_S

    def _read_everything_at_next_tick(self) -> None:
        """Make the next tick read the whole schedule, as django-celery-beat does every 5 minutes."""
        self._last_full_sync = datetime.datetime.min
