"""Password hashing for the tests' own process: Django's PBKDF2, at 1,000 iterations instead of 1.2 million.

Each hash of the default hasher takes 0.4 s on an idle two-core machine, and the admin and
dashboard tests create and log in hundreds of users (and a wrong password is hashed too).
The algorithm keeps its name (``pbkdf2_sha256``) and each hash records its iterations, so a
server a test starts in another process, with the production hashers, checks these passwords
as it checks its own. Production settings keep Django's hashers (``tests/operator/test_passwords.py``).
"""

from django.contrib.auth.hashers import PBKDF2PasswordHasher, get_hashers, get_hashers_by_algorithm

HASHER = "tests.passwords.FewIterationsPBKDF2PasswordHasher"


class FewIterationsPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """``PBKDF2PasswordHasher`` at 1,000 iterations (the tests' process only)."""

    iterations = 1_000


def hash_quickly(settings) -> None:
    """Make ``HASHER`` the only hasher of this process (``settings``: Django's)."""
    settings.PASSWORD_HASHERS = [HASHER]
    get_hashers.cache_clear()
    get_hashers_by_algorithm.cache_clear()
