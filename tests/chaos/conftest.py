"""The chaos suite runs real processes like the e2e suite: the same ``processes`` fixture."""

from tests.e2e.conftest import processes  # noqa: F401  (the fixture, for the tests in this folder)
