"""Reading the committed dashboards and alert rules of deploy/observability/ the way Prometheus
and promtool would: every PromQL expression parsed (``promql-parser``, a binding of the Rust
PromQL parser that GreptimeDB uses), the series and labels each one selects, the rule file's
structure as ``promtool check rules`` validates it (Prometheus's rulefmt), and the
annotation templates rendered with the subset of Go's template language that Prometheus
rules use. Used by tests/unit/router/observability/test_observability_dashboards.py and
tests/integration/frontdoor/test_dashboard_metrics.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import promql_parser
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
OBS_DIR = REPO_ROOT / "deploy" / "observability"
RULES_FILE = OBS_DIR / "alerts" / "pdcluster-rules.yaml"
# Grafana's built-in variables, as Grafana substitutes them before querying.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


@dataclass(frozen=True)
class Query:
    where: str  # "<file>: <panel or alert>"
    expr: str  # as committed (Grafana variables included)

    @property
    def promql(self) -> str:
        out = self.expr
        for var, value in GRAFANA_VARS.items():
            out = out.replace(var, value)
        return out


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value); op "=", "!=", "=~", "!~"


_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


def parse(expr: str):
    """The expression's AST; raises ValueError naming what is wrong."""
    return promql_parser.parse(expr)


def _walk(node) -> list:
    found = []
    promql_parser.walk(node, lambda n: found.append(n))
    return found


def _selectors(node) -> list[Selector]:
    out = []
    for n in _walk(node):
        if isinstance(n, promql_parser.VectorSelector):
            ms = tuple((mt.name, _OPS[str(mt.op).rpartition(".")[2]], mt.value)
                       for mt in n.matchers.matchers)
            out.append(Selector(n.name, ms))
    return out


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of ``expr`` (those inside range selectors too)."""
    return _selectors(parse(expr))


def aggregations(expr: str) -> list[tuple[str, tuple[str, ...], list[Selector]]]:
    """Each aggregation's ``by`` / ``without`` labels with the selectors it aggregates."""
    out = []
    for node in _walk(parse(expr)):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            out.append((str(node), tuple(node.modifier.labels), _selectors(node.expr)))
    return out


def replaced_labels(expr: str) -> set[str]:
    """Labels ``label_replace`` writes."""
    return {str(node.args[1]).strip('"') for node in _walk(parse(expr))
            if isinstance(node, promql_parser.Call) and node.func.name == "label_replace"}


def dashboards(root: Path = REPO_ROOT) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text())
            for p in sorted((root / "deploy/observability/grafana").glob("*.json"))}


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row keeps its panels inside
    return out


def dashboard_queries(root: Path = REPO_ROOT) -> list[Query]:
    return [Query(f"{name}: {p['title']} [{t['refId']}]", t["expr"])
            for name, dash in dashboards(root).items() for p in panels(dash)
            for t in p.get("targets", [])]


def rule_queries(root: Path = REPO_ROOT) -> list[Query]:
    doc = yaml.safe_load((root / RULES_FILE.relative_to(REPO_ROOT)).read_text())
    return [Query(f"{RULES_FILE.name}: {r.get('alert') or r.get('record')}", r["expr"])
            for g in doc["groups"] for r in g["rules"]]


def all_queries(root: Path = REPO_ROOT) -> list[Query]:
    return dashboard_queries(root) + rule_queries(root)


# ---- promtool's rule-file checks (Prometheus model/rulefmt) -----------------------------------
_GROUP_KEYS = {"name", "interval", "query_offset", "limit", "rules", "labels"}
_RULE_KEYS = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_DURATION = re.compile(r"^(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?$")


def valid_duration(value) -> bool:
    """Prometheus's model.ParseDuration: units y w d h m s ms, largest first, no spaces."""
    return isinstance(value, str) and (value == "0" or (value != "" and bool(
        _DURATION.match(value))))


def _string_map(rule: dict, key: str, where: str) -> list[str]:
    found = rule.get(key, {})
    if not isinstance(found, dict):
        return [f"{where}: {key} is not a map"]
    problems = []
    for name, value in found.items():
        if not isinstance(name, str) or not _LABEL_NAME.match(name) or name == "__name__":
            problems.append(f"{where}: invalid {key} name {name!r}")
        if not isinstance(value, str):
            problems.append(f"{where}: {key}.{name} is not a string: {value!r}")
        elif key in ("labels", "annotations"):
            try:
                render_template(value, _AnyLabels(), 1.0)
            except TemplateError as exc:
                problems.append(f"{where}: {key}.{name}: {exc}")
    return problems


def rule_file_problems(doc) -> list[str]:
    """What ``promtool check rules`` would reject in a parsed rule file (empty: valid)."""
    if not isinstance(doc, dict) or set(doc) != {"groups"} or not isinstance(doc["groups"], list):
        return ["the file must be a map with one key, groups: a list"]
    problems, names = [], set()
    for group in doc["groups"]:
        gname = group.get("name") if isinstance(group, dict) else None
        if not gname or not isinstance(gname, str):
            problems.append(f"a group has no name: {group!r}")
            continue
        if gname in names:
            problems.append(f"{gname}: repeated in the same file")
        names.add(gname)
        problems += [f"{gname}: unknown field {k!r}" for k in set(group) - _GROUP_KEYS]
        if "interval" in group and not valid_duration(group["interval"]):
            problems.append(f"{gname}: interval {group['interval']!r} is no duration")
        if not isinstance(group.get("rules"), list):
            problems.append(f"{gname}: rules is not a list")
            continue
        for i, rule in enumerate(group["rules"]):
            problems += _rule_problems(rule, f"{gname}[{i}]")
    return problems


def _rule_problems(rule, where: str) -> list[str]:
    if not isinstance(rule, dict):
        return [f"{where}: not a map"]
    problems = [f"{where}: unknown field {k!r}" for k in set(rule) - _RULE_KEYS]
    kinds = [k for k in ("alert", "record") if rule.get(k)]
    if len(kinds) != 1:
        return problems + [f"{where}: needs exactly one of alert and record, has {kinds}"]
    where = f"{where} {rule[kinds[0]]}"
    if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
        problems.append(f"{where}: field 'expr' must be set")
    else:
        try:
            parse(rule["expr"])
        except ValueError as exc:
            problems.append(f"{where}: expr does not parse: {exc}")
    if kinds == ["record"]:
        if not _METRIC_NAME.match(rule["record"]):
            problems.append(f"{where}: invalid recording rule name")
        problems += [f"{where}: invalid field {k!r} in recording rule"
                     for k in ("annotations", "for", "keep_firing_for") if k in rule]
    elif not _LABEL_NAME.match(rule["alert"]):
        problems.append(f"{where}: invalid alert name")
    for key in ("for", "keep_firing_for"):
        if key in rule and not valid_duration(rule[key]):
            problems.append(f"{where}: {key} {rule[key]!r} is no duration")
    return problems + _string_map(rule, "labels", where) + _string_map(rule, "annotations",
                                                                      where)


# ---- annotation templates (text/template, as Prometheus expands them) --------------------------
class TemplateError(ValueError):
    pass


class _AnyLabels(dict):
    """Labels for a syntax check: every label has a value."""

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: str) -> str:
        return f"<{key}>"


def _humanize(v: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.4g}{unit}"
    return f"{v:.4g}"


def _duration(v: float) -> str:
    if v < 1:
        return f"{v * 1000:.4g}ms"
    minutes, seconds = divmod(v, 60)
    return f"{int(minutes)}m {seconds:.4g}s" if minutes else f"{seconds:.4g}s"


_FUNCS = {"humanize": _humanize, "humanizeDuration": _duration,
          "humanizePercentage": lambda v: f"{v * 100:.4g}%", "humanize1024": _humanize,
          "toUpper": lambda s: str(s).upper(), "toLower": lambda s: str(s).lower()}
_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_PRINTF = re.compile(r'^printf\s+"((?:[^"\\]|\\.)*)"\s+(.+)$')


def _term(term: str, labels: dict, value: float):
    if term == "$value":
        return value
    if m := re.fullmatch(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)", term):
        if m.group(1) not in labels:
            raise TemplateError(f"label {m.group(1)!r} is not in the alert's labels")
        return labels[m.group(1)]
    if m := _PRINTF.match(term):
        try:
            return m.group(1) % _term(m.group(2).strip(), labels, value)
        except TypeError as exc:
            raise TemplateError(f"printf: {exc}") from exc
    raise TemplateError(f"unsupported action {{{{ {term} }}}}")


def render_template(text: str, labels: dict, value: float) -> str:
    """Expand ``text`` as Prometheus would for an alert with ``labels`` and ``value``."""

    def action(m: re.Match) -> str:
        head, *funcs = [p.strip() for p in m.group(1).split("|")]
        out = _term(head, labels, value)
        for f in funcs:
            if f not in _FUNCS:
                raise TemplateError(f"unknown function {f!r}")
            out = _FUNCS[f](out)
        return str(out)

    out = _ACTION.sub(action, text)
    if "{{" in out or "}}" in out:
        raise TemplateError(f"unbalanced braces in {text!r}")
    return out
