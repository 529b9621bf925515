"""The committed gRPC stubs are exactly what ``make proto`` generates from the .proto file,
but for the generator's own version stamp."""

from __future__ import annotations

import re
from pathlib import Path

from proto import generate as gen

# grpcio-tools writes its own version into the stub (``GRPC_GENERATED_VERSION``: the oldest
# grpcio the stub will load under, checked when it is imported, below). A newer grpcio-tools
# release changes that line and nothing else, so the comparison leaves the version out.
_STAMP = re.compile(rb"^(GRPC_GENERATED_VERSION = )'[^']*'$", re.MULTILINE)


def _unstamped(data: bytes) -> bytes:
    return _STAMP.sub(rb"\1'<version>'", data)


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path):
    fresh = gen.generate(tmp_path)
    committed = gen.generated_paths(gen.PROTO_ROOT)
    assert [p.relative_to(tmp_path) for p in fresh] == \
        [p.relative_to(gen.PROTO_ROOT) for p in committed]
    for new, old in zip(fresh, committed, strict=True):
        assert old.exists(), f"{old} is missing: run `make proto`"
        assert _unstamped(new.read_bytes()) == _unstamped(old.read_bytes()), \
            f"{old} is stale: run `make proto`"


def test_generated_stubs_import_through_the_proto_package():
    # Importing the grpc stub raises RuntimeError when the installed grpcio is older than the
    # grpcio-tools that generated it (its GRPC_GENERATED_VERSION).
    from proto.pdcluster.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "pdcluster.v1"
    assert hasattr(generation_pb2_grpc, "GenerationStub")
    # The grpc stub must import the pb2 module through the package, not a top-level name.
    assert generation_pb2_grpc.pdcluster_dot_v1_dot_generation__pb2 is generation_pb2
