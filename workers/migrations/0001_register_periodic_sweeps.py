"""Register runstate's periodic sweeps with django-celery-beat's database scheduler.

Beat needs no manual step: ``migrate`` creates (or updates) these rows. Each sweep is
idempotent and skips rows another sweeper holds, so two beats never double-act.
"""

from django.db import migrations
from django.utils import timezone

SWEEPS = [
    # (name, task, every seconds, expire seconds)
    ("runstate: fire due timers", "runstate.sweep_timers", 1, 5),
    ("runstate: expired leases", "runstate.sweep_leases", 1, 5),
    ("runstate: deadlines and expiries", "runstate.sweep_deadlines", 1, 5),
    ("runstate: dispatch upcoming timers", "runstate.dispatch_upcoming_timers", 60, 55),
    ("runstate: prune old events", "runstate.prune_events", 3600, 600),
]


def register(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTasks = apps.get_model("django_celery_beat", "PeriodicTasks")
    for name, task, every, expire in SWEEPS:
        schedule, _ = IntervalSchedule.objects.get_or_create(every=every, period="seconds")
        PeriodicTask.objects.update_or_create(
            name=name,
            defaults={"task": task, "interval": schedule, "enabled": True, "expire_seconds": expire},
        )
    # Historical models skip django-celery-beat's signals: tell a running beat to reload.
    PeriodicTasks.objects.update_or_create(ident=1, defaults={"last_update": timezone.now()})


def unregister(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name__in=[name for name, *_ in SWEEPS]).delete()


class Migration(migrations.Migration):
    dependencies = [("django_celery_beat", "0019_alter_periodictasks_options")]

    operations = [migrations.RunPython(register, unregister)]
