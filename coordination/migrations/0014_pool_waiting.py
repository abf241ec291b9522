"""Pool.waiting: how many WAITING lease rows a pool has, so the fast paths can tell an empty queue.

Backfilled from the lease rows (gone waiters included: they are still WAITING rows until a
walk or the sweep times them out).
"""

from django.db import migrations, models


def backfill(apps, schema_editor):
    Pool = apps.get_model("coordination", "Pool")
    PoolLease = apps.get_model("coordination", "PoolLease")
    counts = {}
    for pool_id in PoolLease.objects.filter(state="WAITING").values_list("pool_id", flat=True):
        counts[pool_id] = counts.get(pool_id, 0) + 1
    for pool_id, count in counts.items():
        Pool.objects.filter(id=pool_id).update(waiting=count)


class Migration(migrations.Migration):
    dependencies = [
        ("coordination", "0013_task_rerun_of"),
    ]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="waiting",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
