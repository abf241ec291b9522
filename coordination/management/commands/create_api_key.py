"""``python manage.py create_api_key``: issue an API key and print it alone on the last line.

    python manage.py create_api_key --project NAME
        --permissions resource_config,coordination_write,coordination_read
        [--run RUN_ID] [--name NAME] [--expires-at 2030-01-01T00:00:00Z]

The project is ensured; every other input is checked before anything is written, so a
refused call creates nothing.
"""

import uuid
from datetime import UTC, datetime

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_slug
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from coordination.domain.exceptions import CoordinationError
from coordination.models import Run
from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure


def parse_permissions(value: str) -> list[str]:
    """Return the comma-separated permissions in ``value``, or raise ``CommandError``."""
    permissions = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [permission for permission in permissions if permission not in ALL_PERMISSIONS]
    if unknown or not permissions:
        got = f"unknown permission(s) {', '.join(unknown)}" if unknown else "no permission"
        raise CommandError(f"--permissions: {got}; valid permissions: {', '.join(ALL_PERMISSIONS)}.")
    return permissions


def parse_expires_at(value: str | None) -> datetime | None:
    """Return the ISO 8601 time in ``value`` (UTC when it names no offset), or raise ``CommandError``."""
    if value is None:
        return None
    try:
        expires_at = parse_datetime(value)
    except ValueError:
        expires_at = None
    if expires_at is None:
        raise CommandError(f"--expires-at: {value!r} is not an ISO 8601 date and time.")
    if timezone.is_naive(expires_at):
        expires_at = expires_at.replace(tzinfo=UTC)
    if expires_at <= timezone.now():
        raise CommandError(f"--expires-at: {value!r} is not in the future.")
    return expires_at


class Command(BaseCommand):
    help = (
        "Create an API key for a project (ensured) and print it alone on the last line of output. "
        "The key is stored hashed and cannot be shown again."
    )

    def add_arguments(self, parser):  # noqa: D102
        parser.add_argument("--project", required=True, help="Project name; created if it does not exist.")
        parser.add_argument(
            "--permissions",
            required=True,
            help=f"Comma-separated, from: {', '.join(ALL_PERMISSIONS)}.",
        )
        parser.add_argument("--run", help="Bind the key to this run: it sees only the run and the runs below it.")
        parser.add_argument("--name", default="", help="A label for the key.")
        parser.add_argument("--expires-at", help="ISO 8601 time after which the key stops working (UTC if naive).")

    def handle(self, *args, **options):  # noqa: D102
        project_name = options["project"]
        try:
            validate_slug(project_name)
        except ValidationError:
            raise CommandError(
                f"--project: {project_name!r} is not a valid name (letters, digits, '-' and '_')."
            ) from None
        permissions = parse_permissions(options["permissions"])
        expires_at = parse_expires_at(options["expires_at"])
        run_id = self._existing_run_id(options["run"], project_name)

        project = project_ensure(name=project_name)
        try:
            issued = api_key_create(
                project_id=project.id,
                permissions=permissions,
                name=options["name"],
                run_id=run_id,
                expires_at=expires_at,
            )
        except CoordinationError as error:
            raise CommandError(f"{error.code}: {error.message} {error.details or ''}".rstrip()) from None

        api_key = issued.api_key
        label = f"'{api_key.name}'" if api_key.name else "(unnamed)"
        self.stdout.write(
            f"Created API key {label} for project {project.name}: "
            f"permissions {', '.join(api_key.permissions)}; "
            f"{f'bound to run {run_id}' if run_id else 'not bound to a run'}; "
            f"{f'expires {expires_at.isoformat()}' if expires_at else 'never expires'}. "
            "It is shown only now:"
        )
        self.stdout.write(issued.plaintext)

    def _existing_run_id(self, value: str | None, project_name: str) -> uuid.UUID | None:
        """Return the id of the run ``value`` of the project, or raise ``CommandError``.

        Checked before the project is ensured, so a mistyped run creates no project.
        """
        if value is None:
            return None
        try:
            run_id = uuid.UUID(value)
        except ValueError:
            raise CommandError(f"--run: {value!r} is not a run id.") from None
        if not Run.objects.filter(id=run_id, project__name=project_name).exists():
            raise CommandError(f"--run: no run {run_id} in project {project_name}.")
        return run_id
