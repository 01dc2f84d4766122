"""One log format for every process (services/logs.py): text lines or JSON objects, the choice from the
arguments, else the environment a launcher hands its children."""

from __future__ import annotations

import json
import logging

import pytest

from services.logs import FIELDS, LOG_FORMAT_ENV, LOG_LEVEL_ENV, log_choice_env, setup_logging


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def test_json_lines_carry_the_service_and_a_record_s_fields(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("decode", "info", "json")
    logging.getLogger("access").info("GET / 200", extra={FIELDS: {"status": 200, "path": "/"}})
    logging.getLogger("x").debug("hidden at info")
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["service"] == "decode" and record["level"] == "info" and record["logger"] == "access"
    assert record["message"] == "GET / 200" and record["status"] == 200 and record["path"] == "/"
    assert record["time"].endswith("+00:00")


def test_the_environment_gives_the_choice_where_arguments_do_not(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    monkeypatch.setenv(LOG_FORMAT_ENV, "text")
    setup_logging("prefill")
    logging.getLogger("uvicorn.error").warning("uvicorn's too")
    logging.getLogger("x").info("below the level")
    (line,) = capsys.readouterr().err.splitlines()
    assert " prefill WARNING uvicorn's too" in line
    setup_logging("prefill", "debug")  # an argument wins
    logging.getLogger("x").debug("shown")
    assert "prefill DEBUG shown" in capsys.readouterr().err
    assert log_choice_env("debug", None) == {LOG_LEVEL_ENV: "debug"} and log_choice_env(None, None) == {}
    with pytest.raises(ValueError, match="levels"):
        setup_logging("x", "loud")
