"""``python manage.py runstate_dev_setup``: a ready-to-use development project, key and admin.

Used by ``scripts/start``. Idempotent: it ensures the project ``dev``, a development API key
with every permission and a superuser ``admin``. Their secrets are kept under
``settings.VAR_DIR`` (``dev-api-key`` and ``dev-admin-password``, mode 0600) and reused on
the next run; a key that no longer authenticates (revoked, expired, database reset) is
replaced. The API key is printed alone on the last line of output.
"""

import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from coordination.services.keys import ALL_PERMISSIONS, api_key_authenticate, api_key_create, project_ensure

PROJECT_NAME = "dev"
KEY_NAME = "development"
ADMIN_USERNAME = "admin"
KEY_FILE = "dev-api-key"
PASSWORD_FILE = "dev-admin-password"


def read_secret(path: Path) -> str:
    """Return the stripped contents of ``path``, or "" when it does not exist."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def write_secret(path: Path, value: str) -> None:
    """Write ``value`` to ``path`` readable by its owner only (0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    os.chmod(path, 0o600)


class Command(BaseCommand):
    help = (
        "Ensure the development project 'dev', an API key with every permission (kept in "
        "VAR_DIR/dev-api-key) and a superuser 'admin' (password kept in VAR_DIR/dev-admin-password). "
        "Prints the API key alone on the last line."
    )

    def handle(self, *args, **options):
        var_dir = Path(settings.VAR_DIR)
        project = project_ensure(name=PROJECT_NAME)
        password = self._ensure_admin(var_dir / PASSWORD_FILE)
        key, reused = self._ensure_key(project, var_dir / KEY_FILE)

        self.stdout.write(f"Project: {project.name}")
        self.stdout.write(f"Admin: {ADMIN_USERNAME} / {password}")
        self.stdout.write(
            f"API key ({'reused' if reused else 'created'}, all permissions, kept in {var_dir / KEY_FILE}):"
        )
        self.stdout.write(key)

    def _ensure_key(self, project, path: Path) -> tuple[str, bool]:
        """Return the stored key when it still authenticates with every permission, else a new one."""
        plaintext = read_secret(path)
        if plaintext:
            api_key = api_key_authenticate(plaintext)
            if (
                api_key is not None
                and api_key.project_id == project.id
                and api_key.run_id is None
                and set(ALL_PERMISSIONS) <= set(api_key.permissions)
            ):
                os.chmod(path, 0o600)
                return plaintext, True
        issued = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name=KEY_NAME)
        write_secret(path, issued.plaintext)
        return issued.plaintext, False

    def _ensure_admin(self, path: Path) -> str:
        """Ensure the superuser exists and accepts the stored password; return the password."""
        password = read_secret(path)
        if not password:
            password = secrets.token_urlsafe(18)
            write_secret(path, password)
        user_model = get_user_model()
        user = user_model.objects.filter(username=ADMIN_USERNAME).first()
        if user is None:
            user_model.objects.create_superuser(username=ADMIN_USERNAME, email="", password=password)
            return password
        if not (user.is_active and user.is_staff and user.is_superuser and user.check_password(password)):
            user.is_active = user.is_staff = user.is_superuser = True
            user.set_password(password)
            user.save()
        return password
