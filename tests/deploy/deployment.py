"""What deploy/ says, read as the tests need it: the compose services' command lines (with compose's
`${VAR:-default}` interpolation, no variables set), Prometheus's scrape targets, the dashboard's queries."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import promql_parser
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
WORKERS = ("prefill", "decode")
SERVICES = ("router", *WORKERS)
ENCODER = "encoder"
"""The vision encoder: in compose beside the others and scraped (job `encoder`), but running only for a model
with a vision tower (the default tiny model has none), so not among the SERVICES that always serve and export
metrics: a query without a job is checked against those."""
RATE_INTERVAL = "1m"
"""What the dashboard's `$__rate_interval` stands for when a query is parsed or run outside Grafana."""
ALL = ".*"
"""What the dashboard's variables (`$model`, `$instance`, `$pair`) stand for with "All" selected, their
default."""
VARIABLES = ("model", "instance", "pair")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's variable substitution: `${VAR}`, `${VAR:-default}` (unset or empty), `${VAR-default}`
    (unset), `$$` for a dollar."""
    env = env or {}

    def one(match: re.Match) -> str:
        name, dash, default = match.group(1), match.group(2), match.group(3) or ""
        if dash == ":-":
            return env.get(name) or default
        return env.get(name, default if dash else "")

    text = re.sub(r"(?<!\$)\$\{(\w+)(:?-)?([^}]*)\}", one, text)
    return text.replace("$$", "$")


def compose(env: dict[str, str] | None = None) -> dict:
    """deploy/docker-compose.yml, its variables substituted."""
    return yaml.safe_load(interpolate((DEPLOY / "docker-compose.yml").read_text(), env))


def command(service: str, env: dict[str, str] | None = None) -> list[str]:
    """The argv compose runs for `service` (a string command is split as a shell would)."""
    cmd = compose(env)["services"][service]["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def scrape_targets() -> dict[str, str]:
    """Prometheus's statically configured jobs → their one target (host:port), from deploy/prometheus.yml."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    out = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            (out[job["job_name"]],) = static["targets"]
    return out


def discovery_urls() -> dict[str, str]:
    """Prometheus's jobs whose targets HTTP service discovery gives → its URL (deploy/prometheus.yml)."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    return {
        job["job_name"]: sd["url"]
        for job in config["scrape_configs"]
        for sd in job.get("http_sd_configs", [])
    }


def discovered(groups: list[dict]) -> dict[str, str]:
    """An HTTP service discovery answer's targets: their job label → the URL Prometheus scrapes."""
    return {
        g["labels"][
            "job"
        ]: f"{g['labels']['__scheme__']}://{g['targets'][0]}{g['labels']['__metrics_path__']}"
        for g in groups
    }


def scraped_jobs() -> set[str]:
    """Every job Prometheus scrapes: the static ones, and those the router's discovery labels its targets
    with (services/router/supervision.py: the workers' roles) where Prometheus asks it."""
    return set(scrape_targets()) | ({*WORKERS, ENCODER} if discovery_urls() else set())


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "spillway.json").read_text())


def substitute(expr: str) -> str:
    """`expr` as Grafana sends it with every variable at "All": `$__rate_interval` as RATE_INTERVAL."""
    for name in VARIABLES:
        expr = expr.replace(f"${name}", ALL)
    return expr.replace("$__rate_interval", RATE_INTERVAL)


def queries() -> list[str]:
    """Every panel's PromQL, as Prometheus would get it (its variables at "All")."""
    return [substitute(t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def vector_selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every series selector in `expr`; ValueError when Prometheus's grammar refuses it."""
    found: list[promql_parser.VectorSelector] = []

    def walk(node: object) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            found.append(node)
        elif kind == "MatrixSelector":
            walk(node.vector_selector)
        elif kind == "BinaryExpr":
            walk(node.lhs)
            walk(node.rhs)
        elif kind == "Call":
            for arg in node.args:
                walk(arg)
        elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
            walk(node.expr)

    walk(promql_parser.parse(expr))
    return found


def selected_jobs(selector: promql_parser.VectorSelector) -> list[str | None]:
    """The jobs a series selector's `job` matcher names (`a|b` for several), or [None] without one."""
    jobs = [m.value for m in selector.matchers.matchers if m.name == "job"]
    return jobs[0].split("|") if jobs else [None]


def selectors(expr: str) -> list[tuple[str, str | None]]:
    """(metric name, the job it selects or None) for every series selector in `expr`; ValueError when
    Prometheus's grammar refuses it."""
    return [(node.name, job) for node in vector_selectors(expr) for job in selected_jobs(node)]
