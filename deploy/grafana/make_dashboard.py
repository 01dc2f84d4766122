"""Writes `dashboards/spillway.json`, the Grafana dashboard docker-compose provisions (its metrics:
docs/ARCHITECTURE.md, API and metrics).

The panels are listed here as data and built with grafana-foundation-sdk (Grafana 11.1's models); edit
this file and run it (tests/deploy/ check that the two agree and every query against the services' metrics).
Keys are sorted: a run writes the same file twice.

Jobs are Prometheus's (deploy/prometheus.yml): `router`, `prefill`, `decode`, `encoder`; the workers export
metrics of the same names as the router (requests_running, ...), so every query names its job. The encoder
runs only for a model with a vision tower: for a text-only one its target is down, the Images row has no
data and "Services up" shows it "off" (OFF_WHEN_DOWN), not as an outage.

Variables: `$model` (the discovery's label) and `$instance` on every selector of a job in WORKERS, `$pair`
on the pair panels; "All" is `.*`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from grafana_foundation_sdk.builders import bargauge, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.builders import dashboard as board
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="spillway-prometheus")
RATE = "$__rate_interval"
OUT = Path(__file__).parent / "dashboards" / "spillway.json"
WORKERS = ("prefill", "decode", "encoder")
"""Jobs with a target per worker: their selectors take the `$instance` variable."""
ON_INSTANCE = 'instance=~"$instance"'
ON_PAIR = 'pair=~"$pair"'
ON_MODEL = 'model=~"$model"'
OFF_WHEN_DOWN = ("encoder",)
"""Jobs whose target is down by design in some deployments (the encoder, for a text-only model): "Services
up" shows their 0 as a neutral "off", not a red "down"."""
DESCRIPTIONS = {
    "Services up": "encoder: off for a text-only model (it has nothing to encode and exits at start); with a "
    "vision model, off means it is not running.",
    "Encoder rows lent to prefill": "Rows of the encoder's output buffer holding embeddings prefill has not "
    "taken yet: near capacity, image requests wait for rows. Both 0 with --inline (no buffer).",
}
"""Panel descriptions (Grafana's ⓘ), by title, where a reading needs one."""
HEIGHT = 8


def selector(name: str, job: str, *matchers: str) -> str:
    """`name`'s series from `job` (`a|b|...` for several) and `matchers`; a worker's, on `$instance`."""
    on_job = f'job=~"{job}"' if "|" in job else f'job="{job}"'
    on_instance = [ON_INSTANCE, ON_MODEL] if set(job.split("|")) & set(WORKERS) else []
    return f"{name}{{{', '.join([on_job, *matchers, *on_instance])}}}"


def rate(metric: str, job: str, by: str = "") -> str:
    """Per-second rate of a counter, summed (over `by`'s labels when given)."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({selector('spillway:' + metric, job)}[{RATE}]))"


def quantile(q: float, histogram: str, job: str = "router") -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', job, 'le')})"


def quantiles(histogram: str, job: str = "router") -> list[tuple[str, str]]:
    """p50, p95 and p99 of a histogram, each with its legend."""
    return [(quantile(q, histogram, job), f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)]


def hit_rate(by: str = "") -> str:
    hits, misses = (
        rate("expert_cache_hits_total", "decode", by),
        rate("expert_cache_misses_total", "decode", by),
    )
    return f"{hits} / clamp_min({hits} + {misses}, 1e-9)"


def gauge(metric: str, job: str, *matchers: str) -> str:
    return selector(f"spillway:{metric}", job, *matchers)


# A layer's number padded to two digits: the heatmap's rows then sort as layers do (0, 1, ... not 0, 1, 10).
PADDED_LAYER = 'label_replace({expr}, "layer", "0$1", "layer", "(\\\\d)")'


class Spec(NamedTuple):
    """A panel: its title, unit, queries (expr, legend), Grafana type and width (of 24 columns)."""

    title: str
    unit: str
    targets: list[tuple[str, str]]
    kind: str = "timeseries"
    width: int = 8


ROWS: list[tuple[str, list[Spec]]] = [
    (
        "Expert cache",
        [
            Spec("Hit rate, all layers (decode)", "percentunit", [(hit_rate(), "hit rate")]),
            Spec(
                "Hit rate by layer (decode, recent window)",
                "percentunit",
                [(PADDED_LAYER.format(expr=gauge("expert_cache_hit_rate", "decode")), "{{layer}}")],
                "heatmap",
                16,
            ),
            Spec(
                "Host → device expert bytes",
                "Bps",
                [
                    (rate("expert_h2d_bytes_total", "decode"), "decode"),
                    (rate("expert_h2d_bytes_total", "prefill"), "prefill"),
                ],
            ),
            Spec(
                "Misses, evictions, bypasses (decode)",
                "ops",
                [
                    (rate("expert_cache_misses_total", "decode"), "misses"),
                    (rate("expert_cache_evictions_total", "decode"), "evictions"),
                    (rate("expert_cache_bypasses_total", "decode"), "bypasses"),
                ],
            ),
            Spec(
                "Misses by layer (decode)",
                "ops",
                [(rate("expert_cache_misses_total", "decode", "layer"), "{{layer}}")],
            ),
            Spec(
                "Cache slots by layer (decode)",
                "none",
                [(gauge("expert_cache_slots", "decode"), "{{layer}}")],
                "bargauge",
                12,
            ),
            Spec(
                "Lookahead: copies ahead and the lookups they served",
                "ops",
                [
                    (rate("expert_cache_prefetches_total", "decode"), "prefetched"),
                    (rate("expert_cache_prefetch_hits_total", "decode"), "served"),
                ],
                width=6,
            ),
            Spec(
                "Prefill arena loads", "ops", [(rate("arena_loads_total", "prefill"), "experts/s")], width=6
            ),
        ],
    ),
    (
        "Requests",
        [
            Spec(
                "Tokens per second",
                "none",
                [
                    (rate("generation_tokens_total", "router"), "generated"),
                    (rate("prompt_tokens_total", "router"), "prompt"),
                ],
            ),
            Spec("Time to first token", "s", quantiles("time_to_first_token_seconds")),
            Spec("Inter-token latency", "s", quantiles("inter_token_latency_seconds")),
            Spec(
                "Running and waiting",
                "none",
                [
                    (gauge("requests_running", "router"), "running (router)"),
                    (gauge("requests_waiting", "router"), "queued (router)"),
                    (gauge("requests_running", "decode"), "lanes (decode)"),
                    (gauge("requests_waiting", "decode"), "waiting for a lane (decode)"),
                ],
            ),
            Spec(
                "Request latency and queueing (p95)",
                "s",
                [
                    (quantile(0.95, "e2e_request_latency_seconds"), "end to end"),
                    (quantile(0.95, "request_queue_time_seconds"), "queued"),
                ],
            ),
            Spec(
                "Finished and failed requests",
                "reqps",
                [
                    (rate("requests_finished_total", "router", "finish_reason"), "{{finish_reason}}"),
                    (rate("request_errors_total", "router", "reason"), "error: {{reason}}"),
                ],
            ),
        ],
    ),
    (
        "Images",
        [
            Spec(
                "Images encoded and refused",
                "short",
                [
                    (rate("images_encoded_total", "encoder"), "images/s"),
                    (
                        rate("image_requests_refused_total", "encoder", "reason"),
                        "refused requests/s: {{reason}}",
                    ),
                ],
                width=6,
            ),
            Spec(
                "Image tokens per second (embedding rows written)",
                "short",
                [(rate("image_tokens_total", "encoder"), "image tokens/s")],
                width=6,
            ),
            Spec(
                "Encode latency (a request's tower pass)",
                "s",
                quantiles("image_encode_seconds", "encoder"),
                width=6,
            ),
            Spec(
                "Encoder rows lent to prefill",
                "none",
                [
                    (gauge("encoder_rows_lent", "encoder"), "lent"),
                    (gauge("encoder_rows_capacity", "encoder"), "capacity"),
                ],
                width=6,
            ),
        ],
    ),
    (
        "Memory and health",
        [
            Spec("Device memory by pool (decode)", "bytes", [(gauge("vram_bytes", "decode"), "{{pool}}")]),
            Spec(
                "KV pages (decode)",
                "none",
                [
                    (gauge("kv_pages_used", "decode"), "pages used"),
                    (gauge("kv_pages_free", "decode"), "pages free"),
                ],
            ),
            Spec(
                "Memory lent to the expert cache",
                "bytes",
                [(gauge("expert_cache_lent_bytes", "decode"), "lent")],
            ),
            Spec(
                "Services up",
                "none",
                [(selector("up", "router|prefill|decode|encoder"), "{{job}}")],
                "stat",
                12,
            ),
            Spec(
                "Pairs up (router)",
                "none",
                [(gauge("pair_state", "router", 'state="up"', ON_PAIR), "pair {{pair}}")],
                "stat",
                12,
            ),
            Spec(
                "Pair state changes (router)",
                "short",
                [
                    (
                        "sum by (pair, state) "
                        f"(increase({gauge('pair_state_changes_total', 'router', ON_PAIR)}[{RATE}]))",
                        "pair {{pair}} {{state}}",
                    )
                ],
                width=12,
            ),
            Spec(
                "Dropped frames",
                "short",
                [(f"sum by (job) (increase(spillway:dropped_frames_total[{RATE}]))", "{{job}}")],
                width=12,
            ),
        ],
    ),
]
"""The dashboard's rows, each with its panels, laid out left to right and wrapped at 24 columns."""


def up_mappings(down: str, color: str) -> list[model.ValueMapping]:
    """`up`'s 1 as a green "up", its 0 as `down` in `color`."""
    return [
        model.ValueMap(
            options={
                "0": model.ValueMappingResult(text=down, color=color),
                "1": model.ValueMappingResult(text="up", color="green"),
            }
        )
    ]


def layer_heatmap(spec: Spec) -> heatmap.Panel:
    """Each layer's series is one row of cells (already rates: nothing to bucket), joined on time.

    The heatmap reads its colour range, cell unit and hidden values from its options (not fieldConfig): a
    fixed 0–1 scale, percent cells, and no value hidden (a layer at 0 % shows)."""
    color = (
        heatmap.HeatmapColorOptions()
        .mode(HeatmapColorMode.SCHEME)
        .scheme("RdYlGn")
        .steps(64)
        .min(0)
        .max(1)
        .exponent(0.5)
        .scale(HeatmapColorScale.LINEAR)
        .fill("dark-orange")
        .reverse(False)
    )
    join = model.DataTransformerConfig(id_val="joinByField", options={"byField": "Time", "mode": "outer"})
    return (
        heatmap.Panel()
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().axis_placement(common.AxisPlacement.LEFT))
        .cell_gap(1)
        .color(color)
        .cell_values(heatmap.CellValues().unit(spec.unit).decimals(0))
        .filter_values(heatmap.FilterValueRange().le(-1))
        .with_transformation(join)
    )


def up_stat(spec: Spec) -> stat.Panel:
    """`up`-like values as "up"/"down"; a job in OFF_WHEN_DOWN, when queried, "off" rather than "down"."""
    out = stat.Panel().mappings(up_mappings("down", "red"))
    off = [model.DynamicConfigValue(id_val="mappings", value=up_mappings("off", "text"))]
    for job in OFF_WHEN_DOWN:
        if any(job in expr for expr, _ in spec.targets):
            out = out.override_by_name(job, off)
    return out


KINDS: dict[str, Callable[[Spec], timeseries.Panel | bargauge.Panel | heatmap.Panel | stat.Panel]] = {
    "timeseries": lambda _: timeseries.Panel(),
    "bargauge": lambda _: bargauge.Panel(),
    "heatmap": layer_heatmap,
    "stat": up_stat,
}
"""Each panel type's builder, with what that type needs beyond the common settings."""


def query(ref: int, expr: str, legend: str) -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .ref_id(chr(ord("A") + ref))
        .datasource(DATASOURCE)
        .expr(expr)
        .legend_format(legend)
    )


def panel(pid: int, spec: Spec) -> Builder[model.Panel]:
    out = (
        KINDS[spec.kind](spec)
        .id(pid)
        .title(spec.title)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .height(HEIGHT)
        .span(spec.width)
        .targets([query(i, expr, legend) for i, (expr, legend) in enumerate(spec.targets)])
    )
    return out.description(DESCRIPTIONS[spec.title]) if spec.title in DESCRIPTIONS else out


def variable(name: str, label: str, values: str, sort: model.VariableSort) -> board.QueryVariable:
    """A multi-select of `values`' results, "All" (`.*`) at first, refreshed with the time range."""
    return (
        board.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(values)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(model.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def variables() -> list[board.QueryVariable]:
    workers = "|".join(WORKERS)
    return [
        variable(
            "model",
            "Model",
            f'label_values(up{{job=~"{workers}"}}, model)',
            model.VariableSort.ALPHABETICAL_ASC,
        ),
        variable(
            "instance",
            "Instance",
            f'label_values(up{{job=~"{workers}"}}, instance)',
            model.VariableSort.ALPHABETICAL_ASC,
        ),
        variable("pair", "Pair", "label_values(spillway:pair_state, pair)", model.VariableSort.NUMERICAL_ASC),
    ]


def dashboard() -> board.Dashboard:
    out = (
        board.Dashboard("Spillway")
        .uid("spillway")
        .tags(["spillway"])
        .timezone("browser")
        .version(1)
        .editable()
        .refresh("5s")
        .time("now-15m", "now")
        .variables(variables())
        .annotations([])
    )
    ids = itertools.count(1)
    for title, specs in ROWS:
        out = out.with_row(board.Row(title).id(next(ids)).collapsed(False))
        for spec in specs:
            out = out.with_panel(panel(next(ids), spec))
    return out


def render() -> str:
    return (
        json.dumps(dashboard().build(), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    )


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
