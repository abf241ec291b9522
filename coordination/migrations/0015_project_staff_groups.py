"""Project.staff_groups and the view_every_project permission: which staff see which project (issue 25)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("coordination", "0014_pool_waiting"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="project",
            options={
                "ordering": ["name"],
                "permissions": [("view_every_project", "Can see every project in the admin and the dashboard")],
            },
        ),
        migrations.AddField(
            model_name="project",
            name="staff_groups",
            field=models.ManyToManyField(
                blank=True,
                help_text="Staff in these groups see this project in the admin and the dashboard.",
                related_name="runstate_projects",
                to="auth.group",
            ),
        ),
    ]
