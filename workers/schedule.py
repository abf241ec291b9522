"""The periodic sweeps beat runs, registered in code (never by hand).

The migrations register them when the schema is created; ``ensure_periodic_sweeps`` runs again
each time beat starts, so a database that lost the rows (restored, flushed) gets them back.
"""

from django.db import transaction
from django.utils import timezone

# (name, task, every seconds, expire seconds). Each sweep is idempotent and skips rows
# another sweeper holds, so two beats or two workers never double-act.
PERIODIC_SWEEPS = [
    ("runstate: fire due timers", "runstate.sweep_timers", 1, 5),
    ("runstate: expired leases", "runstate.sweep_leases", 1, 5),
    ("runstate: deadlines and expiries", "runstate.sweep_deadlines", 1, 5),
    ("runstate: re-wake unclaimed bound work", "runstate.rewake_unclaimed_work", 5, 5),
    ("runstate: dispatch upcoming timers", "runstate.dispatch_upcoming_timers", 60, 55),
    ("runstate: prune old events", "runstate.prune_events", 3600, 600),
]


@transaction.atomic
def ensure_periodic_sweeps() -> int:
    """Create or update the periodic sweeps in django-celery-beat's tables; return how many changed."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks

    changed = 0
    for name, task, every, expire in PERIODIC_SWEEPS:
        schedule, _ = IntervalSchedule.objects.get_or_create(every=every, period=IntervalSchedule.SECONDS)
        current = PeriodicTask.objects.filter(name=name).first()
        wanted = {"task": task, "interval": schedule, "enabled": True, "expire_seconds": expire}
        if current is None or any(getattr(current, field) != value for field, value in wanted.items()):
            PeriodicTask.objects.update_or_create(name=name, defaults=wanted)
            changed += 1
    if changed:
        PeriodicTasks.objects.update_or_create(ident=1, defaults={"last_update": timezone.now()})
    return changed
