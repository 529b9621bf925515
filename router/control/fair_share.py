"""Per-tenant weighted fair share of decode room (``pdcluster serve --tenant-weights``).

When requests wait for room on the decode workers (the cluster is full), the room that frees
goes first to the highest priority, and among equal priorities to the tenant furthest below
its share: the one whose requests holding room now, divided by its weight, is lowest. A
tenant's burst then queues behind its own requests, not in front of another tenant's: with
weights 2 and 1 and both tenants waiting, they hold room about 2:1. Tenants are read off the
backend's request ids (``<tenant>/<id>``: router/frontdoor/security.py); without API keys every
caller is one tenant and this changes nothing."""

from __future__ import annotations

from collections import Counter

DEFAULT_WEIGHT = 1.0


def tenant_of(request_id: str) -> str:
    """The tenant a backend request id belongs to ("" without API keys)."""
    head, sep, _ = request_id.partition("/")
    return head if sep else ""


def parse_tenant_weights(value, flag: str = "--tenant-weights") -> dict[str, float]:
    """``--tenant-weights`` ("name=weight,..." or, in YAML, a mapping) as a dict; also any
    flag of that shape (``flag`` names it in errors: ``--tenant-deadlines``). ValueError
    names a bad entry (values must be numbers > 0)."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = []
        for part in str(value).split(","):
            name, eq, w = part.strip().partition("=")
            if not eq:
                raise ValueError(f"{flag}: {part.strip()!r}: expected name=value")
            items.append((name.strip(), w.strip()))
    out = {}
    for name, w in items:
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"{flag}: {name}: {w!r} is not a number") from None
        if not name or not weight > 0 or weight == float("inf"):
            raise ValueError(f"{flag}: {name!r}: must be a number > 0, got {w!r}")
        out[str(name)] = weight
    return out


class TenantShares:
    """Which tenant's requests hold decode room now, against their weights. ``admitted`` when
    a request gets room (once per request, however often it moves), ``ended`` when it ends."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self._holding: Counter[str] = Counter()
        self._admitted: dict[str, str] = {}  # request id -> tenant

    def share(self, tenant: str) -> float:
        """Requests holding room / weight: lower goes first."""
        return self._holding[tenant] / self.weights.get(tenant, DEFAULT_WEIGHT)

    def admitted(self, request_id: str) -> None:
        if request_id not in self._admitted:
            tenant = tenant_of(request_id)
            self._admitted[request_id] = tenant
            self._holding[tenant] += 1

    def ended(self, request_id: str) -> None:
        tenant = self._admitted.pop(request_id, None)
        if tenant is not None:
            self._holding[tenant] -= 1
            if not self._holding[tenant]:
                del self._holding[tenant]

    @property
    def holding(self) -> dict[str, int]:
        """Tenant -> its requests holding room now (a leak shows here)."""
        return dict(self._holding)
