"""Issue 25: the admin login is throttled, per username and per client address.

Failures are counted in the API rate limit's windows (``coordination.api.throttling``): in
Redis when the broker is Redis, else in the process. Each test uses its own usernames and
addresses, so windows left in the shared Redis by an earlier run never meet it.
"""

import random
import uuid

import pytest
from django.contrib.auth.models import User

from coordination.api import throttling
from coordination.api.throttling import LocalWindows

pytestmark = pytest.mark.django_db

LOGIN = "/admin/login/?next=/admin/"
PASSWORD = "right-password-1"
THROTTLED = "Too many failed logins"


@pytest.fixture(autouse=True)
def fresh_local_windows(monkeypatch):
    monkeypatch.setattr(throttling.limiter, "local", LocalWindows())


@pytest.fixture
def operator(db):
    return User.objects.create_user(f"op-{uuid.uuid4().hex[:8]}", password=PASSWORD, is_staff=True)


def an_address() -> str:
    return f"10.{random.randrange(256)}.{random.randrange(256)}.{random.randrange(1, 255)}"


def log_in(client, username: str, password: str, address: str):
    return client.post(LOGIN, {"username": username, "password": password}, REMOTE_ADDR=address)


def logged_in(client) -> bool:
    return "_auth_user_id" in client.session


class Clock:
    """A monotonic clock the test moves by hand (the in-process windows read it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_failed_logins_are_refused_even_with_the_right_password_until_the_window_passes(
    client, settings, operator, monkeypatch
):
    settings.CELERY_BROKER_URL = "filesystem://"  # counted in the process, on the clock below
    settings.RUNSTATE_ADMIN_LOGIN_LIMIT = "3/15min"
    clock = Clock()
    monkeypatch.setattr(throttling, "time", clock)
    address = an_address()
    for _ in range(3):
        wrong = log_in(client, operator.username, "wrong", address)
        assert wrong.status_code == 200 and THROTTLED not in wrong.content.decode()
    assert not logged_in(client)

    refused = log_in(client, operator.username, PASSWORD, address)

    assert refused.status_code == 200
    assert THROTTLED in refused.content.decode() and "Try again in 15 minute(s)" in refused.content.decode()
    assert not logged_in(client)
    # The same username from another address is refused too: the username has its own window.
    assert THROTTLED in log_in(client, operator.username, PASSWORD, an_address()).content.decode()
    assert not logged_in(client)

    clock.now += 14 * 60
    assert THROTTLED in log_in(client, operator.username, PASSWORD, address).content.decode()
    clock.now += 60  # the window has passed
    accepted = log_in(client, operator.username, PASSWORD, address)
    assert accepted.status_code == 302 and accepted["Location"] == "/admin/"
    assert logged_in(client)


def test_failures_are_counted_in_redis_for_every_process(client, settings, operator):
    if not settings.CELERY_BROKER_URL.startswith("redis://"):
        pytest.skip("the suite runs without Redis")
    settings.RUNSTATE_ADMIN_LOGIN_LIMIT = "3/hour"
    address = an_address()
    for _ in range(3):
        log_in(client, operator.username, "wrong", address)

    assert THROTTLED in log_in(client, operator.username, PASSWORD, address).content.decode()
    assert not logged_in(client)
    # Another process (its own limiter, its own in-process windows) reads the same count.
    another = throttling.Limiter()
    rate = throttling.parse_rate("3/hour")
    assert another.hit(f"admin-login:user:{operator.username}", rate, cost=0)[0] == 3
    assert another.hit(f"admin-login:address:{address}", rate, cost=0)[0] == 3


def test_failures_from_one_address_refuse_every_username_from_it(client, settings, operator):
    settings.RUNSTATE_ADMIN_LOGIN_LIMIT = "3/hour"
    address = an_address()
    for n in range(3):  # spraying: a different username each time
        log_in(client, f"nobody-{uuid.uuid4().hex[:8]}-{n}", "guess", address)

    assert THROTTLED in log_in(client, operator.username, PASSWORD, address).content.decode()
    assert not logged_in(client)

    elsewhere = log_in(client, operator.username, PASSWORD, an_address())
    assert elsewhere.status_code == 302 and logged_in(client)


def test_successful_logins_are_not_counted(client, settings, operator):
    settings.RUNSTATE_ADMIN_LOGIN_LIMIT = "2/hour"
    address = an_address()
    for _ in range(5):
        response = log_in(client, operator.username, PASSWORD, address)
        assert response.status_code == 302 and logged_in(client)
        client.logout()


def test_the_limit_can_be_turned_off(client, settings, operator):
    settings.RUNSTATE_ADMIN_LOGIN_LIMIT = "off"
    address = an_address()
    for _ in range(8):
        log_in(client, operator.username, "wrong", address)
    assert log_in(client, operator.username, PASSWORD, address).status_code == 302
