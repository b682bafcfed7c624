"""The server tests' fixtures (a live uvicorn server around an app) for the fault tests."""

from tests.server.conftest import serve, serve_real  # noqa: F401 - fixtures, found by name
