"""The tests' process hashes passwords with few iterations (tests/passwords.py); servers and production do not."""

import importlib

from django.contrib.auth.hashers import PBKDF2PasswordHasher, check_password, get_hasher, make_password

from tests.passwords import FewIterationsPBKDF2PasswordHasher


def test_this_process_hashes_with_few_iterations_and_a_default_hasher_checks_it():
    assert isinstance(get_hasher(), FewIterationsPBKDF2PasswordHasher)
    encoded = make_password("secret")
    algorithm, iterations, _, _ = encoded.split("$")
    assert (algorithm, iterations) == ("pbkdf2_sha256", "1000")
    # A server started in another process, with Django's hashers, checks it.
    assert PBKDF2PasswordHasher().verify("secret", encoded)
    assert not PBKDF2PasswordHasher().verify("wrong", encoded)
    # A password hashed at Django's iterations is still checked here.
    assert check_password("secret", PBKDF2PasswordHasher().encode("secret", "somesalt", iterations=2))


def test_the_projects_settings_keep_djangos_hashers():
    settings_module = importlib.import_module("runstate_project.settings")
    assert not hasattr(settings_module, "PASSWORD_HASHERS")
