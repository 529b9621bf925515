"""A request's deadline, as the doors hand it to the admission: the caller's own (gRPC
deadline, ``x-request-timeout``), else its tenant's default (``--tenant-deadlines``, then
``*``), else none; bad settings refused before serving."""

from __future__ import annotations

import pytest

from router.cli.main import build_parser
from router.cli.serve_config import serve_config_from_args
from router.frontdoor.security import Gate, SecurityConfig, Tenant


def test_the_callers_deadline_wins_then_the_tenants_then_every_tenants():
    gate = Gate(SecurityConfig(tenant_deadlines={"gold": 2.0, "*": 30.0}), {})
    gold, other = Tenant("gold", "gold/"), Tenant("free", "free/")
    assert gate.deadline_for(gold, 0.5) == 0.5
    assert gate.deadline_for(gold, None) == 2.0
    assert gate.deadline_for(other, None) == 30.0
    assert Gate(SecurityConfig(), {}).deadline_for(other, None) is None


def test_the_flag_reaches_the_gate_and_bad_values_are_named():
    cfg = serve_config_from_args(build_parser().parse_args(
        ["serve", "--tenant-deadlines", "gold=2,*=30"]))
    assert cfg.security_config().tenant_deadlines == {"gold": 2.0, "*": 30.0}
    for value, match in (("gold", "expected name=value"), ("gold=0", "must be a number > 0"),
                         ("gold=soon", "is not a number")):
        with pytest.raises(ValueError, match=match):
            serve_config_from_args(build_parser().parse_args(
                ["serve", "--tenant-deadlines", value])).security_config()
    with pytest.raises(ValueError, match="not a tenant name"):
        SecurityConfig(tenant_deadlines={"two words": 1.0})
