"""The fp32 backends of the front-door checks that need the float products: one embedded
engine and one 1+1 cluster (tests/helpers/fp32_backends.py) for both modules of this package,
as tests/integration/frontdoor/ shares its backends. Each cost ~5-20 s to start, and both
modules started their own. `make test` hands this package to one pytest worker whole
(tests/conftest.py, ``pytest_xdist_make_scheduler``)."""

from __future__ import annotations

import pytest

from tests.helpers.fp32_backends import fp32_backend


@pytest.fixture(scope="package")
def otlp():
    """One OTLP receiver for the package's backends (they export to it for as long as they
    live); the integration modules' own is per module."""
    from bench.harness.otlp_receiver import OtlpReceiver

    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def embedded_backend(server_loop, otlp):
    with fp32_backend("embedded", server_loop, otlp) as b:
        yield b


@pytest.fixture(scope="package")
def cluster_backend(server_loop, otlp):
    with fp32_backend("cluster", server_loop, otlp) as b:
        yield b


@pytest.fixture(scope="package", params=["embedded", "cluster"])
def backend(request):
    """The same checks over the fp32 in-process engine and the fp32 cluster. Both stay up
    while a pytest process runs this package's modules and are shut down before its last test
    is done, so no other module's Ray meets this cluster's. Tests leave them as they found
    them: no KV block held (``kv_probe``)."""
    return request.getfixturevalue(f"{request.param}_backend")
