"""Register the re-wake sweep of work bound to decorated Celery tasks (``runstate.rewake_unclaimed_work``)."""

from django.db import migrations
from django.utils import timezone

NAME = "runstate: re-wake unclaimed bound work"
TASK = "runstate.rewake_unclaimed_work"
EVERY_S = 5


def register(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTasks = apps.get_model("django_celery_beat", "PeriodicTasks")
    schedule, _ = IntervalSchedule.objects.get_or_create(every=EVERY_S, period="seconds")
    PeriodicTask.objects.update_or_create(
        name=NAME, defaults={"task": TASK, "interval": schedule, "enabled": True, "expire_seconds": EVERY_S}
    )
    # Historical models skip django-celery-beat's signals: tell a running beat to reload.
    PeriodicTasks.objects.update_or_create(ident=1, defaults={"last_update": timezone.now()})


def unregister(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name=NAME).delete()


class Migration(migrations.Migration):
    dependencies = [("workers", "0001_register_periodic_sweeps")]

    operations = [migrations.RunPython(register, unregister)]
