"""Option sources, precedence and the errors for bad config input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stdengine.config import parse_engine_args, resolve
from stdengine.errors import ConfigError


def test_defaults_when_nothing_is_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    r = resolve({}, env={})
    assert r.options.ctx_size == 4096 and r.sources["ctx_size"] == "default"
    assert r.config_path is None
    assert r.explicitly_set() == set()


def test_precedence_flag_over_env_over_file_over_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text("threads = 1\nctx_size = 1024\ntemp = 0.5\n")
    env = {"INFER_THREADS": "3", "INFER_CTX_SIZE": "2048"}
    r = resolve({"threads": 5}, config=str(cfg), env=env)
    assert (r.options.threads, r.sources["threads"]) == (5, "flag")
    assert (r.options.ctx_size, r.sources["ctx_size"]) == (2048, "env INFER_CTX_SIZE")
    assert (r.options.temp, r.sources["temp"]) == (0.5, f"file {cfg}")
    assert (r.options.top_k, r.sources["top_k"]) == (40, "default")
    assert r.explicitly_set() == {"threads", "ctx_size", "temp"}


def test_infer_toml_in_cwd_then_user_dir(tmp_path, monkeypatch):
    user = tmp_path / "cfg" / "stdengine"
    user.mkdir(parents=True)
    (user / "infer.toml").write_text("threads = 7\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert resolve({}, env={}).options.threads == 7
    (work / "infer.toml").write_text("threads = 9\n")
    r = resolve({}, env={})
    assert r.options.threads == 9 and r.config_path == Path("infer.toml")


def test_json_config_and_engine_args(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"top_k": 10, "engine_args": {"a": "1"}}))
    r = resolve({"engine_args": {"b": "2"}}, config=str(cfg), env={})
    assert r.options.top_k == 10
    assert r.options.engine_args == {"a": "1", "b": "2"}


def test_misspelt_key_names_file_line_and_suggestion(tmp_path):
    cfg = tmp_path / "infer.toml"
    cfg.write_text("model = 'x'\n\nctx_sise = 100\n")
    with pytest.raises(ConfigError) as e:
        resolve({}, config=str(cfg), env={})
    assert f"{cfg}:3" in e.value.message and "ctx_sise" in e.value.message
    assert "did you mean 'ctx_size'" in (e.value.hint or "")
    assert "threads" in (e.value.hint or "")  # the valid keys are listed


def test_wrong_type_names_key_and_expected_type(tmp_path):
    cfg = tmp_path / "infer.toml"
    cfg.write_text("temp = 0.1\nthreads = 'many'\n")
    with pytest.raises(ConfigError) as e:
        resolve({}, config=str(cfg), env={})
    assert "'threads'" in e.value.message and f"{cfg}:2" in e.value.message
    assert "int" in (e.value.hint or "")


def test_env_errors_name_the_variable():
    with pytest.raises(ConfigError, match="INFER_CTX_SIZE"):
        resolve({}, env={"INFER_CTX_SIZE": "big"})
    with pytest.raises(ConfigError, match="INFER_MMAP"):
        resolve({}, env={"INFER_MMAP": "maybe"})


def test_env_booleans_and_lists():
    r = resolve({}, env={"INFER_MMAP": "off", "INFER_STOP": '["a", "b"]', "INFER_FLASH_ATTN": "1"})
    assert r.options.mmap is False and r.options.flash_attn is True and r.options.stop == ["a", "b"]
    assert resolve({}, env={"INFER_STOP": "###"}).options.stop == ["###"]


def test_bad_toml_and_missing_config_file(tmp_path):
    cfg = tmp_path / "infer.toml"
    cfg.write_text("threads = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve({}, config=str(cfg), env={})
    with pytest.raises(ConfigError, match="not found"):
        resolve({}, config=str(tmp_path / "nope.toml"), env={})
    cfg.write_bytes(b"threads = 2 # \xff\n")
    with pytest.raises(ConfigError, match=r"not valid UTF-8 \(byte 14"):
        resolve({}, config=str(cfg), env={})
    with pytest.raises(ConfigError, match="it is a directory"):
        resolve({}, config=str(tmp_path), env={})


@pytest.mark.parametrize("line", ["threads = true", "temp = false", "ctx_size = true"])
def test_a_boolean_for_a_number_is_refused_not_taken_as_one(tmp_path, line):
    cfg = tmp_path / "infer.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(ConfigError, match="expected a number, not true or false"):
        resolve({}, config=str(cfg), env={})


def test_out_of_range_value_is_refused():
    with pytest.raises(ConfigError, match="top_p"):
        resolve({"top_p": 1.5}, env={})


def test_match_section_is_reserved_for_recipes(tmp_path):
    cfg = tmp_path / "r.toml"
    cfg.write_text("threads = 2\n[match]\narchitecture = 'llama'\n")
    r = resolve({}, config=str(cfg), env={})
    assert r.match == {"architecture": "llama"}
    cfg.write_text("[match]\narchitectur = 'llama'\n")
    with pytest.raises(ConfigError, match="architectur"):
        resolve({}, config=str(cfg), env={})


def test_engine_args_parsing():
    assert parse_engine_args(["a=1", "b=x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_engine_args(["novalue"])
