"""Django's PostgreSQL backend with a connection pool that fails fast while the server is down."""
