"""A multi-host ``DATABASE_URL`` reaches psycopg whole: every host, every port, target_session_attrs."""

import pytest
from django.db.backends.postgresql.base import DatabaseWrapper

from runstate_project import dburl

MULTI = "postgres://app:s%40cret@db1.internal:5433,db2.internal:5434/runstate?target_session_attrs=read-write"


def test_a_multi_host_url_keeps_every_host_and_port():
    parsed = dburl.parse(MULTI, conn_max_age=0, conn_health_checks=True)
    assert parsed["ENGINE"] == "django.db.backends.postgresql"
    assert (parsed["HOST"], parsed["PORT"]) == ("db1.internal,db2.internal", "5433,5434")
    assert (parsed["USER"], parsed["PASSWORD"], parsed["NAME"]) == ("app", "s@cret", "runstate")
    assert parsed["OPTIONS"] == {"target_session_attrs": "read-write"}
    assert parsed["CONN_HEALTH_CHECKS"] is True


def test_django_hands_psycopg_the_lists_as_libpq_takes_them():
    settings_dict = {**dburl.parse(MULTI), "TIME_ZONE": None, "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False}
    settings_dict.update(CONN_MAX_AGE=0, CONN_HEALTH_CHECKS=False, TEST={})
    params = DatabaseWrapper(settings_dict).get_connection_params()
    assert (params["host"], params["port"]) == ("db1.internal,db2.internal", "5433,5434")
    assert params["target_session_attrs"] == "read-write"
    assert params["dbname"] == "runstate"


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("postgres://u@a,b/db", "a,b", ""),
        ("postgres://u@[::1]:5433,127.0.0.1:5434/db", "::1,127.0.0.1", "5433,5434"),
        ("postgres://u@h:5432/db", "h", 5432),  # one host: dj_database_url's own answer
    ],
)
def test_hosts_without_ports_ipv6_and_a_single_host(url, host, port):
    parsed = dburl.parse(url)
    assert (parsed["HOST"], parsed["PORT"]) == (host, port)
