"""tests/deploy's own scope for its stack (defined in tests/fixtures/deploy.py).

A package-scoped fixture lives as long as the package it is defined in: from the plugin it
would outlive tests/deploy and keep six idle services polling for the rest of the session.
"""

from tests.fixtures.deploy import deploy_stack, otlp_receiver  # noqa: F401 (fixtures, registered here)
