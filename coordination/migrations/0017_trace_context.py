"""Task and Message carry their submitter's W3C trace context (issue 29).

A constant default: PostgreSQL adds the columns without rewriting the tables.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("coordination", "0016_event_partitions"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="traceparent",
            field=models.CharField(blank=True, db_default="", default="", max_length=55),
        ),
        migrations.AddField(
            model_name="message",
            name="tracestate",
            field=models.CharField(blank=True, db_default="", default="", max_length=512),
        ),
        migrations.AddField(
            model_name="task",
            name="traceparent",
            field=models.CharField(blank=True, db_default="", default="", max_length=55),
        ),
        migrations.AddField(
            model_name="task",
            name="tracestate",
            field=models.CharField(blank=True, db_default="", default="", max_length=512),
        ),
    ]
