"""The launcher's placement of prefill/decode pairs (a GPU each on CUDA, none on the CPU) and of the vision
encoder (for a model with a vision tower: its inbox given to the router and every prefill worker)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.ipc.transport import ipc_address
from services.children import MAX_QUICK_EXITS, Child, restart_exited
from services.cli import _encoder_device, build_parser
from services.encoder.main import encoder_parser
from services.launch import ServeOptions, has_vision, pair_gpus, router_argv, service_children


def test_pairs_on_the_cpu_need_no_gpu() -> None:
    assert pair_gpus(1, "cuda:1") == [None], "one pair runs where its flags say"
    assert pair_gpus(3, "cpu") == [None, None, None]


def test_each_pair_takes_the_next_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert pair_gpus(2, "cuda") == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="needs a GPU a pair; this machine shows 1"):
        pair_gpus(2, "cuda")


def test_one_gpu_named_for_every_pair_is_refused() -> None:
    with pytest.raises(ValueError, match="use --device cuda, not cuda:1"):
        pair_gpus(2, "cuda:1")
    with pytest.raises(ValueError, match="at least 1"):
        pair_gpus(0, "cpu")


# -- the vision encoder among the children ------------------------------------------------------------------


def _flag(argv: list[str], flag: str) -> list[str]:
    """Every value `flag` takes in `argv`."""
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def _model_dir(tmp_path: Path, vision: bool) -> Path:
    root = tmp_path / ("vision" if vision else "text")
    root.mkdir()
    config = {"model_type": "qwen4_exp", "vision_config": {"depth": 1}} if vision else {"model_type": "x"}
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_an_encoder_runs_beside_the_pairs_and_both_router_and_prefill_reach_it(tmp_path: Path) -> None:
    opts = ServeOptions("/m", metrics_port=9000, pair_gpus=[None, None], encoder_device="cpu")
    opts.encoder_dtype, opts.threads = "bfloat16", 2
    children = {c.name: c for c in service_children(opts, tmp_path)}
    assert list(children) == ["encoder", "decode", "prefill", "decode-1", "prefill-1", "router"]
    encoder = children["encoder"]
    inbox = ipc_address(tmp_path, "encoder")
    assert encoder.argv[1:3] == ["-m", "services.encoder"] and encoder.gpu is None
    assert _flag(encoder.argv, "--inbox") == [inbox]
    assert _flag(encoder.argv, "--router") == [ipc_address(tmp_path, "router")]
    assert _flag(encoder.argv, "--prefill") == [
        f"prefill={ipc_address(tmp_path, 'prefill')}",
        f"prefill-1={ipc_address(tmp_path, 'prefill-1')}",
    ]
    assert _flag(encoder.argv, "--device") == ["cpu"] and _flag(encoder.argv, "--dtype") == ["bfloat16"]
    assert _flag(encoder.argv, "--threads") == ["2"] and "--exit-with-parent" in encoder.argv
    assert _flag(encoder.argv, "--metrics-port") == ["9005"], "M+1+2·pairs: after the last pair's"
    for name in ("prefill", "prefill-1", "router"):
        assert _flag(children[name].argv, "--encoder") == [inbox], name
    for name in ("decode", "decode-1"):
        assert "--encoder" not in children[name].argv
    metrics = _flag(children["router"].argv, "--worker-metrics")
    assert "encoder=http://127.0.0.1:9005/metrics" in metrics and len(metrics) == 5
    encoder_parser().parse_args(encoder.argv[3:])  # the encoder's own parser takes it


def test_one_pair_puts_the_encoder_metrics_on_m_plus_3(tmp_path: Path) -> None:
    opts = ServeOptions("/m", metrics_port=9000, encoder_device="cpu")
    (encoder, *_) = service_children(opts, tmp_path)
    assert _flag(encoder.argv, "--metrics-port") == ["9003"]
    opts.metrics_port = 0
    (encoder, *_) = service_children(opts, tmp_path)
    assert "--metrics-port" not in encoder.argv


def test_without_an_encoder_nothing_names_one(tmp_path: Path) -> None:
    children = service_children(ServeOptions("/m"), tmp_path)
    assert [c.name for c in children] == ["decode", "prefill", "router"]
    assert not any("--encoder" in c.argv for c in children)
    argv = router_argv(
        ServeOptions("/m", encoder_device="cpu"), "tcp://h:1", [("tcp://p:2", "tcp://d:3")], {}
    )
    assert "--encoder" not in argv, "an encoder address is the caller's to give"


def test_serve_starts_an_encoder_for_a_vision_model_only(tmp_path: Path) -> None:
    vision, text = _model_dir(tmp_path, True), _model_dir(tmp_path, False)
    assert has_vision(vision) and not has_vision(text)

    def device(*flags: str, model: Path = vision) -> str | None:
        return _encoder_device(build_parser().parse_args(["serve", *flags]), str(model))

    assert device() == "cpu" and device(model=text) is None
    assert device("--no-encoder") is None
    assert device("--ray", "auto") == "cpu", "the Ray launcher's encoder runs here, beside the router"
    assert device("--ray", "auto", "--pairs", "2", "--encoder-device", "cpu") == "cpu"
    with pytest.raises(ValueError, match="--encoder-device"):
        device("--encoder-device", "cuda:99")
    with pytest.raises(SystemExit):
        device("--encoder-device", "tpu")


def test_an_exit_after_coming_up_is_no_start_up_failure() -> None:
    """Four quick exits in a row give up (start-up failures); a worker that was up and then died (killed,
    crashed by a request) is restarted however soon it dies."""
    from services.children import MAX_QUICK_EXITS, Child

    child = Child("decode", ["true"])
    for _ in range(MAX_QUICK_EXITS):
        child.started, child.came_up = time.monotonic(), True
        child.count_exit()
    assert child.quick_exits == 0
    for _ in range(MAX_QUICK_EXITS):
        child.started, child.came_up = time.monotonic(), False
        child.count_exit()
    assert child.quick_exits == MAX_QUICK_EXITS


def test_the_launcher_marks_up_the_children_health_says_are(tmp_path: Path) -> None:
    from services.launch import Launcher

    opts = ServeOptions(model_dir=str(tmp_path), host="127.0.0.1", port=1, worker_args=[])
    launcher = Launcher(opts)
    try:
        procs = {c.name: subprocess.Popen(["sleep", "30"]) for c in launcher.children}
        for child in launcher.children:
            child.proc = procs[child.name]
        prefill, decode = (
            next(c for c in launcher.children if c.name.startswith(r)) for r in ("prefill", "decode")
        )
        services = {
            prefill.name: {"pid": prefill.proc.pid, "state": "up"},
            decode.name: {"pid": decode.proc.pid + 100000, "state": "up"},  # an earlier start's pid
        }
        launcher.mark_up({"status": "degraded", "services": services})
        assert prefill.came_up and not decode.came_up
        assert next(c for c in launcher.children if c.name == "router").came_up  # it answered
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        launcher.router.close()
        shutil.rmtree(launcher.run_dir, ignore_errors=True)


def test_a_gone_launchers_run_directory_is_swept(tmp_path: Path) -> None:
    from services.launch import OWNER, sweep_run_dirs

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live, unnamed = (tmp_path / f"spillway-{n}" for n in ("dead", "live", "unnamed"))
    for run_dir in (dead, live, unnamed):
        run_dir.mkdir()
        (run_dir / "decode.sock").touch()
    (dead / OWNER).write_text(str(gone.pid))
    (live / OWNER).write_text(str(os.getpid()))
    assert sweep_run_dirs(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and unnamed.exists()


def test_a_service_removes_only_its_own_launchers_run_directory(tmp_path: Path) -> None:
    from services.parent_watch import OWNER, remove_run_dir

    ours, theirs = tmp_path / "spillway-ours", tmp_path / "spillway-theirs"
    for run_dir, owner in ((ours, 41), (theirs, 42)):
        run_dir.mkdir()
        (run_dir / OWNER).write_text(str(owner))
    remove_run_dir(str(ours), 41)
    remove_run_dir(str(theirs), 41)
    remove_run_dir(str(tmp_path / "spillway-gone"), 41)
    assert not ours.exists() and theirs.exists()


def test_the_ports_checked_are_those_the_services_bind(tmp_path: Path) -> None:
    opts = ServeOptions(
        model_dir=str(tmp_path), port=8000, metrics_port=9000, pair_gpus=[None, None], encoder_device="cpu"
    )
    children = service_children(opts, tmp_path)
    bound = {int(c.argv[c.argv.index("--metrics-port") + 1]) for c in children}
    assert sorted(opts.ports().values()) == [8000, *sorted(bound)] == [8000, *range(9000, 9006)]


def test_the_key_reaches_every_service_in_its_environment_never_its_argv(tmp_path: Path) -> None:
    opts = ServeOptions("/m", api_key="sk-secret", metrics_port=9000, encoder_device="cpu")
    children = service_children(opts, tmp_path)
    assert {c.name for c in children} == {"encoder", "prefill", "decode", "router"}
    for child in children:
        assert not any("sk-secret" in arg for arg in child.argv) and "--api-key" not in child.argv
        assert child.env == {"SPILLWAY_API_KEY": "sk-secret"}
    assert all(c.env == {} for c in service_children(ServeOptions("/m"), tmp_path))


def test_the_pixel_budgets_pass_from_serve_to_the_router(tmp_path: Path) -> None:
    from services.router.main import config_from_args, parse_args

    args = build_parser().parse_args(["serve", "--max-image-pixels", "500", "--max-request-pixels", "900"])
    opts = ServeOptions(
        "/m", max_image_pixels=args.max_image_pixels, max_request_pixels=args.max_request_pixels
    )
    argv = router_argv(opts, "ipc:///r", [("ipc:///p", "ipc:///d")], {})
    config = config_from_args(parse_args(argv[3:]))  # past `python -m services.router`
    assert (config.max_image_pixels, config.max_request_pixels) == (500, 900)
    default = config_from_args(parse_args(router_argv(ServeOptions("/m"), "ipc:///r", [("a", "b")], {})[3:]))
    assert (default.max_image_pixels, default.max_request_pixels) == (2**25, 2**27)


def test_a_child_that_keeps_failing_at_start_up_is_given_up() -> None:
    """A child that exits at once every start is restarted until MAX_QUICK_EXITS failures in a row, then
    `restart_exited` names it (the launcher gives up) instead of restarting it forever."""
    child = Child("decode", [sys.executable, "-c", "raise SystemExit(3)"])
    child.start()
    given_up = None
    deadline = time.monotonic() + 60
    while given_up is None and time.monotonic() < deadline:
        assert child.proc is not None
        child.proc.wait(timeout=30)
        given_up = restart_exited([child], None)
    assert given_up is child
    assert child.quick_exits == MAX_QUICK_EXITS and child.restarts == MAX_QUICK_EXITS - 1
    assert child.proc is not None and child.proc.returncode == 3
