"""Task.rerun_of: the finished task a rerun submits again (``POST /v1/tasks/{id}/rerun``).

Task.last_renewed_at: when the current lease was granted or last extended, so that the
dashboard and metrics can tell a cancellation that is stuck behind a renewing worker.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("coordination", "0012_admissions"),
    ]

    operations = [
        migrations.AddField(
            model_name="task",
            name="rerun_of",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="reruns",
                to="coordination.task",
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="last_renewed_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="task",
            index=models.Index(
                condition=models.Q(("rerun_of__isnull", False)), fields=["rerun_of"], name="task_rerun_of"
            ),
        ),
    ]
