"""Every series the dashboards and alert rules of deploy/observability/ read is exported by a
live server: its /metrics, scraped after a request (labelled histograms have no series
before one), holds each family a query selects, with the labels the catalogue
(router/observability/catalog.py) gives it and every label value a query matches on
(``le="2.5"``, ``phase="kv_transfer_tail"``, ``role="decode"``...).

Runs over both backends of this package (conftest.py: the embedded engine and the
disaggregated Ray cluster, started once for every front-door module). Only the cluster
exports the phase histogram and the store gauge, so the embedded engine must miss exactly
those. The autoscaler's families exist only under ``serve --autoscale``
(tests/integration/test_autoscale.py scrapes them off a real autoscaling cluster); here the
backend's stats carry an autoscaler's state, so the same exporter writes them on this scrape.
"""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.frontdoor.lifecycle import serve_frontdoor
from router.observability import catalog
from tests.helpers.observability_queries import all_queries, selectors

PROMPT = "The capital of France is"
# Families only a disaggregated cluster exports (the embedded engine has no prefill / decode
# split to time and no cluster store).
CLUSTER_ONLY = {catalog.PHASES.name, catalog.STORE_UP.name, catalog.KV_TRANSFER_SECONDS.name}


class _Autoscaling:
    """The package's backend, its stats as an autoscaling cluster's (every call but
    ``stats`` goes straight to it)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def stats(self):
        return dataclasses.replace(
            await self._inner.stats(), autoscaler_desired={"prefill": 1, "decode": 2},
            autoscaler_decisions={("decode", "up", "load"): 1,
                                  ("decode", "up", "unplaceable"): 1})


@pytest.fixture(scope="module")
def frontdoor(backend, server_loop):
    """This module's front door (overrides conftest's): over the package's backend, which
    it does not own, reporting an autoscaler."""
    fd = server_loop.run(serve_frontdoor(_Autoscaling(backend), grpc_port=0, http_port=0,
                                         drain_grace_s=5))
    yield fd
    server_loop.run(fd.stop(1))


def _series_of(fam) -> set[str]:
    """The series names a scraped family may hold (whether or not it has samples yet)."""
    if fam.type == "counter":
        return {f"{fam.name}_total"}
    if fam.type == "histogram":
        return {f"{fam.name}_{s}" for s in ("bucket", "sum", "count")}
    return {fam.name}


def test_every_series_the_dashboards_and_rules_read_is_exported(http, backend):
    resp = http.post("/v1/completions",
                     json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    scrape = http.get("/metrics")
    assert scrape.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    exported = {s for f in families.values() for s in _series_of(f)}
    read = {sel.name: catalog.family_of(sel.name) for q in all_queries()
            for sel in selectors(q.promql)}
    assert read
    missing = {fam.name for series, fam in read.items() if series not in exported}
    clustered = backend.model_info().mode != "embedded"
    assert missing == (set() if clustered else CLUSTER_ONLY), (
        f"read by dashboards or rules but not exported: {sorted(missing)}")

    present = {f.name: f for f in read.values() if f.name in families}
    empty = {name for name in present if not families[name].samples}
    # The embedded engine has no tensor-parallel ranks moving KV: that family has no series.
    assert empty == (set() if clustered else {catalog.KV_RANK_TRANSFER_BYTES.name}), empty
    for fam in present.values():
        samples = families[fam.name].samples
        labels = {k for s in samples for k in s.labels} - {"le"}
        assert not samples or labels == set(fam.labels), (fam.name, labels)
        if fam.kind != "histogram":
            assert families[fam.name].type == fam.kind, fam.name


def test_every_label_value_a_query_matches_on_is_exported(http, backend):
    """``role`` values are the cluster's (prefill, decode; the embedded engine's worker is
    ``embedded``); the rest are the same for both."""
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    values: dict[str, set[tuple[str, str]]] = {}
    for f in text_string_to_metric_families(http.get("/metrics").text):
        for s in f.samples:
            values.setdefault(s.name, set()).update(s.labels.items())
    clustered = backend.model_info().mode != "embedded"
    checked = 0
    for q in all_queries():
        for sel in selectors(q.promql):
            for label, op, value in sel.matchers:
                if op != "=" or sel.name not in values or (label == "role" and not clustered):
                    continue
                assert (label, value) in values[sel.name], (
                    f"{q.where}: {sel.name}{{{label}={value!r}}} matches nothing exported")
                checked += 1
    # At least the SLO buckets (TTFT 2.5, ITL 0.25) and the unplaceable decisions; on the
    # cluster also the phase and the roles.
    assert checked >= (9 if clustered else 4), checked
