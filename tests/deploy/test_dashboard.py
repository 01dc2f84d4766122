"""The Grafana dashboard and Prometheus config agree with what the services export (deploy/grafana/)."""

from __future__ import annotations

import importlib.util

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry

from common import metrics
from tests.deploy.deployment import (
    ALL,
    DEPLOY,
    ENCODER,
    RATE_INTERVAL,
    SERVICES,
    WORKERS,
    command,
    dashboard,
    queries,
    scraped_jobs,
    selected_jobs,
    selectors,
    vector_selectors,
)


def _registry(job: str) -> CollectorRegistry:
    """The metric groups `job` builds (the router: RouterMetrics; the encoder: the worker shell's
    WorkerMetrics and EncoderMetrics; prefill and decode: WorkerMetrics, the cache's; decode also the KV
    pool's)."""
    registry = metrics.new_registry()
    if job == "router":
        metrics.RouterMetrics.create(registry)
    elif job == ENCODER:
        metrics.WorkerMetrics.create(registry)
        metrics.EncoderMetrics.create(registry)
    else:
        metrics.WorkerMetrics.create(registry)
        metrics.ExpertCacheMetrics.create(registry)
        if job == "decode":
            metrics.KvPoolMetrics.create(registry)
    return registry


def series_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry's families can expose (a counter's `_total`, a histogram's parts)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in registry.collect() for s in suffixes[f.type]}


EXPORTED = {job: series_names(_registry(job)) | {"up"} for job in (*SERVICES, ENCODER)}


def test_the_dashboard_is_what_its_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("make_dashboard", DEPLOY / "grafana" / "make_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUT.read_text() == module.render(), "run python deploy/grafana/make_dashboard.py"


@pytest.mark.parametrize("expr", queries())
def test_a_query_parses_and_reads_what_its_job_exports(expr: str) -> None:
    found = selectors(expr)
    assert found, f"no series in {expr}"
    for name, job in found:
        jobs = [job] if job else list(SERVICES)
        assert all(j in scraped_jobs() for j in jobs), f"{expr}: job {job} is not scraped"
        assert any(name in EXPORTED[j] for j in jobs), f"{expr}: {name} is not exported by {jobs}"


def test_the_checks_refuse_a_misspelled_or_misplaced_metric() -> None:
    with pytest.raises(ValueError):
        selectors("sum(rate(spillway:expert_cache_hits_total[1m])")  # unbalanced
    name, job = selectors('spillway:expert_cache_hit_rate{job="router"}')[0]
    assert name not in EXPORTED[job], "the router has no expert cache"
    assert "spillway:expert_cache_hit_total" not in EXPORTED["decode"]
    name, job = selectors('spillway:encoder_rows_lent{job="decode"}')[0]
    assert name not in EXPORTED[job] and name in EXPORTED[ENCODER], "only the encoder lends rows"


def test_the_encoder_is_scraped_and_its_images_are_on_the_dashboard() -> None:
    """Its target is down for a text-only model (the default): "Services up" says "off" for it, not down."""
    assert ENCODER in scraped_jobs() and "encoder=http://encoder:9403/metrics" in command("router")
    read = {name for expr in queries() for name, job in selectors(expr) if job == ENCODER}
    assert {n for n in EXPORTED[ENCODER] if "image" in n or "encoder_rows" in n} <= read | {
        "spillway:image_encode_seconds_sum",
        "spillway:image_encode_seconds_count",
    }, "every encoder metric has a panel"
    (services_up,) = [p for p in dashboard()["panels"] if p["title"] == "Services up"]
    assert ENCODER in services_up["targets"][0]["expr"]
    (override,) = services_up["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byName", "options": ENCODER}
    assert override["properties"][0]["value"][0]["options"]["0"]["text"] == "off"


def test_panels_fit_the_grid_and_use_the_provisioned_datasource() -> None:
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == source["uid"] and p["targets"], p["title"]
    assert any(p["type"] == "heatmap" and "layer" in p["title"] for p in panels), (
        "docs/ARCHITECTURE.md, API and metrics: a per-layer heatmap"
    )


def test_the_worker_panels_filter_on_model_and_instance_and_the_pair_panels_on_pair() -> None:
    """`model` (the router's discovery labels the workers' targets with it), `instance` (the workers'
    targets) and `pair` (the router's pairs) are multi-selects whose "All" is `.*`; every selector of a
    worker's job (prefill, decode, encoder) matches `model=~"$model"` and `instance=~"$instance"`, every
    selector of a pair's state `pair=~"$pair"`."""
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == {"model", "instance", "pair"}
    assert variables["model"]["query"] == 'label_values(up{job=~"prefill|decode|encoder"}, model)'
    assert variables["instance"]["query"] == 'label_values(up{job=~"prefill|decode|encoder"}, instance)'
    assert variables["pair"]["query"] == "label_values(spillway:pair_state, pair)"
    for v in variables.values():
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ALL, v["name"]
    workers, pairs = 0, 0
    for expr in (t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])):
        for node in vector_selectors(expr.replace("$__rate_interval", RATE_INTERVAL)):
            matchers = [(m.name, m.op, m.value) for m in node.matchers.matchers]
            if {*WORKERS, ENCODER} & set(selected_jobs(node)):
                workers += 1
                assert ("instance", promql_parser.MatchOp.Re, "$instance") in matchers, expr
                assert ("model", promql_parser.MatchOp.Re, "$model") in matchers, expr
            if node.name.startswith("spillway:pair_state"):
                pairs += 1
                assert ("pair", promql_parser.MatchOp.Re, "$pair") in matchers, expr
    assert workers > 20 and pairs == 2


def test_the_heatmap_fixes_its_scale_in_the_options_grafana_reads() -> None:
    """Grafana's heatmap takes its colour range, cell unit and value filter from `options` (it ignores
    fieldConfig's min and max): a 0–1 scale, percent cells, and no layer hidden at a 0 % hit rate."""
    (heatmap,) = [p for p in dashboard()["panels"] if p["type"] == "heatmap"]
    options = heatmap["options"]
    assert (options["color"]["min"], options["color"]["max"]) == (0, 1)
    assert options["cellValues"]["unit"] == "percentunit" and options["calculate"] is False
    assert options["filterValues"]["le"] < 0, "the default (le 1e-9) hides cells at 0"
