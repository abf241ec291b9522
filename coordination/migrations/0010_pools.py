"""Pools: a concurrency limit per project and its requests (waiter rows, then leases)."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

import coordination.domain.ids
from coordination.migrations._postgres import execute_on_postgres

# A cancel's cascade finds the subtree's pool waiters by path prefix (see 0004 for why
# text_pattern_ops); only WAITING rows, the few that a cancel has to answer.
FORWARD = [
    "CREATE INDEX IF NOT EXISTS poollease_waiting_run_path ON coordination_poollease (run_path text_pattern_ops) "
    "WHERE state = 'WAITING'",
]
BACKWARD = ["DROP INDEX IF EXISTS poollease_waiting_run_path"]


def forward(apps, schema_editor):
    execute_on_postgres(schema_editor, FORWARD)


def backward(apps, schema_editor):
    execute_on_postgres(schema_editor, BACKWARD)


class Migration(migrations.Migration):
    dependencies = [
        ("coordination", "0009_process_cache_notify"),
    ]

    operations = [
        migrations.CreateModel(
            name="Pool",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=coordination.domain.ids.uuid7, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("name", models.CharField(max_length=200)),
                ("capacity", models.PositiveIntegerField()),
                ("in_use", models.PositiveIntegerField(default=0)),
                ("arrivals", models.PositiveBigIntegerField(default=0)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="+", to="coordination.project"
                    ),
                ),
            ],
            options={
                "ordering": ["name"],
            },
        ),
        migrations.CreateModel(
            name="PoolLease",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=coordination.domain.ids.uuid7, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("run_path", models.TextField(editable=False)),
                ("units", models.PositiveIntegerField()),
                ("lease_ttl_ms", models.PositiveIntegerField()),
                ("key", models.CharField(blank=True, default="", max_length=200)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("WAITING", "Waiting"),
                            ("HELD", "Held"),
                            ("RELEASED", "Released"),
                            ("EXPIRED", "Expired"),
                            ("TIMED_OUT", "Timed Out"),
                            ("CANCELLED", "Cancelled"),
                        ],
                        default="WAITING",
                        max_length=16,
                    ),
                ),
                ("arrival", models.PositiveBigIntegerField()),
                ("expires_at", models.DateTimeField()),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ("granted_at", models.DateTimeField(blank=True, null=True)),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                (
                    "pool",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="leases", to="coordination.pool"
                    ),
                ),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="+", to="coordination.project"
                    ),
                ),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="pool_leases", to="coordination.run"
                    ),
                ),
            ],
            options={
                "ordering": ["arrival"],
            },
        ),
        migrations.AddConstraint(
            model_name="pool",
            constraint=models.UniqueConstraint(fields=("project", "name"), name="pool_name_per_project"),
        ),
        migrations.AddIndex(
            model_name="poollease",
            index=models.Index(
                condition=models.Q(("state", "WAITING")), fields=["pool", "arrival"], name="poollease_waiting"
            ),
        ),
        migrations.AddIndex(
            model_name="poollease",
            index=models.Index(
                condition=models.Q(("state__in", ["WAITING", "HELD"])), fields=["expires_at"], name="poollease_open_due"
            ),
        ),
        migrations.AddIndex(
            model_name="poollease",
            index=models.Index(fields=["run", "created_at"], name="poollease_run_created"),
        ),
        migrations.AddConstraint(
            model_name="poollease",
            constraint=models.UniqueConstraint(
                condition=models.Q(("state__in", ["WAITING", "HELD"]), models.Q(("key", ""), _negated=True)),
                fields=("pool", "key"),
                name="poollease_open_key_once",
            ),
        ),
        migrations.RunPython(forward, backward),
    ]
