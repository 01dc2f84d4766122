"""The `spillway` command as a user runs it: separate processes, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPILLWAY_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_generate_creates_and_uses_the_default_model(tmp_path: Path) -> None:
    first = _run(["generate", "--chat", "Hello there", "--max-tokens", "12", "--json"], tmp_path)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert {"prompt_ids", "token_ids", "text", "tok_per_s"} <= set(out)
    model_dir = Path(out["model"])
    assert model_dir.parent == tmp_path / "models" and (model_dir / "config.json").is_file()
    tok = Tokenizer.from_dir(model_dir)
    assert out["prompt_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=True
    )
    assert 1 <= len(out["token_ids"]) <= 12 and out["text"] == tok.decode(out["token_ids"])
    assert out["tok_per_s"] > 0

    again = _run(["generate", "--chat", "Hello there", "--max-tokens", "12", "--json"], tmp_path)
    assert json.loads(again.stdout)["token_ids"] == out["token_ids"]  # greedy by default, same model reused


@pytest.mark.slow
def test_make_model_then_generate_with_overrides(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    made = _run(
        [
            "make-model",
            "--preset",
            "tiny",
            "--arch",
            "mixtral",
            "--set",
            "num_local_experts=5",
            "--set",
            "tie_word_embeddings=true",
            "--seed",
            "3",
            "--out",
            str(model_dir),
        ],
        tmp_path,
    )
    assert made.returncode == 0, made.stderr
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_local_experts"] == 5 and config["tie_word_embeddings"] is True
    gen = _run(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "The cache",
            "--max-tokens",
            "5",
            "--temperature",
            "0.7",
            "--seed",
            "1",
            "--dtype",
            "bfloat16",
            "--json",
        ],
        tmp_path,
    )
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout)["token_ids"]) <= 5


def test_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"model_type": "nope"}))
    result = _run(["generate", "--model", str(tmp_path / "broken"), "--prompt", "x"], tmp_path)
    assert result.returncode == 2
    assert "model_type 'nope' is not supported" in result.stderr and "config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_override_is_a_clear_error(tmp_path: Path) -> None:
    result = _run(["make-model", "--set", "num_experts", "--out", str(tmp_path / "x")], tmp_path)
    assert result.returncode == 2 and "num_experts" in result.stderr and "Traceback" not in result.stderr
