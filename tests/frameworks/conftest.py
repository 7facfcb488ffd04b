"""The third-party-client tests use the dialect tests' gateway fixtures."""

from tests.dialects.conftest import counting_engine, tls_cert  # noqa: F401 (fixtures)
from tests.gateway.conftest import make_gateway  # noqa: F401 (fixture)
