"""Writes `dashboards/spillway.json`, the Grafana dashboard docker-compose provisions (its metrics:
docs/ARCHITECTURE.md, API and metrics).

The panels are listed here, as data, because Grafana's JSON is long and repetitive; edit this file and run
`python deploy/grafana/make_dashboard.py` (tests/deploy/test_dashboard.py checks that the two agree, that
every query parses and that every metric it reads is one the services export, under the right job).

Jobs are Prometheus's (deploy/prometheus.yml): `router`, `prefill`, `decode`, `encoder`; the workers export
metrics of the same names as the router (requests_running, ...), so every query names its job. The encoder
runs only for a model with a vision tower: for a text-only one its target is down, the Images row has no
data and "Services up" shows it "off" (OFF_WHEN_DOWN), not as an outage.
"""

from __future__ import annotations

import json
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "spillway-prometheus"}
RATE = "$__rate_interval"
OUT = Path(__file__).parent / "dashboards" / "spillway.json"
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


def rate(metric: str, job: str, by: str = "") -> str:
    """Per-second rate of a counter, summed (over `by`'s labels when given)."""
    group = f" by ({by})" if by else ""
    return f'sum{group} (rate(spillway:{metric}{{job="{job}"}}[{RATE}]))'


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


# A layer's number padded to two digits: the heatmap's rows then sort as layers do (0, 1, ... not 0, 1, 10).
PADDED_LAYER = 'label_replace({expr}, "layer", "0$1", "layer", "(\\\\d)")'

# (title, unit, [(expr, legend)], panel type, width); a None entry starts a row named by the title.
PANELS: list[tuple] = [
    ("Expert cache", None, None, None, None),
    ("Hit rate, all layers (decode)", "percentunit", [(hit_rate(), "hit rate")], "timeseries", 8),
    (
        "Hit rate by layer (decode, recent window)",
        "percentunit",
        [(PADDED_LAYER.format(expr='spillway:expert_cache_hit_rate{job="decode"}'), "{{layer}}")],
        "heatmap",
        16,
    ),
    (
        "Host → device expert bytes",
        "Bps",
        [
            (rate("expert_h2d_bytes_total", "decode"), "decode"),
            (rate("expert_h2d_bytes_total", "prefill"), "prefill"),
        ],
        "timeseries",
        8,
    ),
    (
        "Misses, evictions, bypasses (decode)",
        "ops",
        [
            (rate("expert_cache_misses_total", "decode"), "misses"),
            (rate("expert_cache_evictions_total", "decode"), "evictions"),
            (rate("expert_cache_bypasses_total", "decode"), "bypasses"),
        ],
        "timeseries",
        8,
    ),
    (
        "Misses by layer (decode)",
        "ops",
        [(rate("expert_cache_misses_total", "decode", "layer"), "{{layer}}")],
        "timeseries",
        8,
    ),
    (
        "Cache slots by layer (decode)",
        "none",
        [('spillway:expert_cache_slots{job="decode"}', "{{layer}}")],
        "bargauge",
        12,
    ),
    (
        "Lookahead: copies ahead and the lookups they served",
        "ops",
        [
            (rate("expert_cache_prefetches_total", "decode"), "prefetched"),
            (rate("expert_cache_prefetch_hits_total", "decode"), "served"),
        ],
        "timeseries",
        6,
    ),
    ("Prefill arena loads", "ops", [(rate("arena_loads_total", "prefill"), "experts/s")], "timeseries", 6),
    ("Requests", None, None, None, None),
    (
        "Tokens per second",
        "none",
        [
            (rate("generation_tokens_total", "router"), "generated"),
            (rate("prompt_tokens_total", "router"), "prompt"),
        ],
        "timeseries",
        8,
    ),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds"), "timeseries", 8),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds"), "timeseries", 8),
    (
        "Running and waiting",
        "none",
        [
            ('spillway:requests_running{job="router"}', "running (router)"),
            ('spillway:requests_waiting{job="router"}', "queued (router)"),
            ('spillway:requests_running{job="decode"}', "lanes (decode)"),
            ('spillway:requests_waiting{job="decode"}', "waiting for a lane (decode)"),
        ],
        "timeseries",
        8,
    ),
    (
        "Request latency and queueing (p95)",
        "s",
        [
            (quantile(0.95, "e2e_request_latency_seconds"), "end to end"),
            (quantile(0.95, "request_queue_time_seconds"), "queued"),
        ],
        "timeseries",
        8,
    ),
    (
        "Finished and failed requests",
        "reqps",
        [
            (rate("requests_finished_total", "router", "finish_reason"), "{{finish_reason}}"),
            (rate("request_errors_total", "router", "reason"), "error: {{reason}}"),
        ],
        "timeseries",
        8,
    ),
    ("Images", None, None, None, None),
    (
        "Images encoded and refused",
        "short",
        [
            (rate("images_encoded_total", "encoder"), "images/s"),
            (rate("image_requests_refused_total", "encoder", "reason"), "refused requests/s: {{reason}}"),
        ],
        "timeseries",
        6,
    ),
    (
        "Image tokens per second (embedding rows written)",
        "short",
        [(rate("image_tokens_total", "encoder"), "image tokens/s")],
        "timeseries",
        6,
    ),
    (
        "Encode latency (a request's tower pass)",
        "s",
        quantiles("image_encode_seconds", "encoder"),
        "timeseries",
        6,
    ),
    (
        "Encoder rows lent to prefill",
        "none",
        [
            ('spillway:encoder_rows_lent{job="encoder"}', "lent"),
            ('spillway:encoder_rows_capacity{job="encoder"}', "capacity"),
        ],
        "timeseries",
        6,
    ),
    ("Memory and health", None, None, None, None),
    (
        "Device memory by pool (decode)",
        "bytes",
        [('spillway:vram_bytes{job="decode"}', "{{pool}}")],
        "timeseries",
        8,
    ),
    (
        "KV pages (decode)",
        "none",
        [
            ('spillway:kv_pages_used{job="decode"}', "pages used"),
            ('spillway:kv_pages_free{job="decode"}', "pages free"),
        ],
        "timeseries",
        8,
    ),
    (
        "Memory lent to the expert cache",
        "bytes",
        [('spillway:expert_cache_lent_bytes{job="decode"}', "lent")],
        "timeseries",
        8,
    ),
    ("Services up", "none", [('up{job=~"router|prefill|decode|encoder"}', "{{job}}")], "stat", 12),
    (
        "Pairs up (router)",
        "none",
        [('spillway:pair_state{job="router", state="up"}', "pair {{pair}}")],
        "stat",
        12,
    ),
    (
        "Pair state changes (router)",
        "short",
        [(f'sum by (pair, state) (increase(spillway:pair_state_changes_total{{job="router"}}[{RATE}]))',
          "pair {{pair}} {{state}}")],
        "timeseries",
        12,
    ),
    (
        "Dropped frames",
        "short",
        [(f"sum by (job) (increase(spillway:dropped_frames_total[{RATE}]))", "{{job}}")],
        "timeseries",
        12,
    ),
]


def panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], kind: str, pos: dict) -> dict:
    out = {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": pos,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
        "options": {},
    }
    if title in DESCRIPTIONS:
        out["description"] = DESCRIPTIONS[title]
    if kind == "heatmap":
        # Each layer's series is one row of cells (already rates: nothing to bucket), joined on time.
        # The heatmap reads its colour range, cell unit and hidden values from its options (not
        # fieldConfig): a fixed 0–1 scale, percent cells, and no value hidden (a layer at 0 % shows).
        color = {"mode": "scheme", "scheme": "RdYlGn", "steps": 64, "min": 0, "max": 1}
        out["options"] = {
            "calculate": False,
            "yAxis": {"axisPlacement": "left"},
            "cellGap": 1,
            "color": {**color, "exponent": 0.5, "scale": "linear", "fill": "dark-orange", "reverse": False},
            "cellValues": {"unit": unit, "decimals": 0},
            "filterValues": {"le": -1},
        }
        out["transformations"] = [{"id": "joinByField", "options": {"byField": "Time", "mode": "outer"}}]
    if kind == "stat":
        out["fieldConfig"]["defaults"]["mappings"] = up_mappings("down", "red")
        out["fieldConfig"]["overrides"] = [
            {"matcher": {"id": "byName", "options": job}, "properties": [
                {"id": "mappings", "value": up_mappings("off", "text")}]}
            for job in OFF_WHEN_DOWN if any(job in expr for expr, _ in targets)
        ]  # fmt: skip
    return out


def up_mappings(down: str, color: str) -> list[dict]:
    """`up`'s 1 as a green "up", its 0 as `down` in `color`."""
    return [
        {
            "type": "value",
            "options": {"0": {"text": down, "color": color}, "1": {"text": "up", "color": "green"}},
        }
    ]


def dashboard() -> dict:
    panels, x, y, row_height = [], 0, 0, 0
    for title, unit, targets, kind, width in PANELS:
        if targets is None:
            y += row_height
            x, row_height = 0, 0
            panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
            y += 1
            continue
        if x + width > 24:
            x, y = 0, y + row_height
        pos = {"h": 8, "w": width, "x": x, "y": y}
        panels.append(panel(len(panels) + 1, title, unit, targets, kind, pos))
        x, row_height = x + width, 8
    return {
        "uid": "spillway",
        "title": "Spillway",
        "tags": ["spillway"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "panels": panels,
        "templating": {"list": []},
        "annotations": {"list": []},
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
