"""What every verb shares: canonical option flags, resolving them, the emitter, loading an
engine, and turning errors into one clear line and a documented exit status."""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, get_args, get_origin

import click

from stdengine.errors import InferError, Interrupted
from stdengine.options import DEFAULTS, OPTION_NAMES, Options, env_var, flags

F = Callable[..., Any]


def _click_option(name: str) -> Callable[[F], F]:
    info = Options.model_fields[name]
    names = flags(name)
    ann = info.annotation
    args = [a for a in get_args(ann) if a is not type(None)]
    base = args[0] if get_origin(ann) is not None and args else ann
    shown = default_text(name)
    help_text = f"{info.description} [{f'default: {shown}; ' if shown else ''}env: {env_var(name)}]"
    if name == "engine_args":
        return click.option("-E", "engine_args", multiple=True, metavar="KEY=VALUE", help=info.description)
    if base is bool:
        shorts = [f for f in names if not f.startswith("--")]
        long = next(f for f in names if f.startswith("--"))
        return click.option(*shorts, f"{long}/--no-{long[2:]}", name, default=None, help=help_text)
    if get_origin(ann) is list:
        return click.option(*names, name, multiple=True, help=help_text)
    if get_origin(base) is not None and get_args(base) and all(isinstance(a, str) for a in get_args(base)):
        return click.option(*names, name, type=click.Choice(get_args(base)), default=None, help=help_text)
    click_type: Any = base if base in (int, float, str) else str
    return click.option(*names, name, type=click_type, default=None, help=help_text)


def default_text(name: str) -> str:
    """An option's default as its --help shows it; "" when there is none to show (null: the
    engine decides, which the option's help says; an empty list or table)."""
    value = DEFAULTS[name]
    if name == "model":
        from stdengine import DEFAULT_MODEL

        return f"{DEFAULT_MODEL} (engines that load a file)"
    if value is None or value == [] or value == {}:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


# Options of `infer serve` alone: where it listens and how many requests it serves at once.
# (--url and --api-key also name a remote engine and its key, so `infer run -e openai` takes them.)
SERVER_ONLY = ("host", "port", "parallel")
# Options of a verb that runs one engine for one user (run, chat): all but the server's.
CLIENT_OPTIONS = tuple(n for n in OPTION_NAMES if n not in SERVER_ONLY)


def canonical_options(*names: str) -> Callable[[F], F]:
    """Add the flags of these canonical options (all of them when none are named), plus --config
    and -v, to a click command."""

    chosen = names or OPTION_NAMES

    def decorate(f: F) -> F:
        for name in reversed([n for n in OPTION_NAMES if n in chosen]):
            f = _click_option(name)(f)
        f = click.option(
            "--config",
            "config_path",
            metavar="PATH",
            help="config file (TOML or JSON); default ./infer.toml, then the user config dir",
        )(f)
        f = click.option(
            "--recipe",
            "recipe",
            metavar="PATH|NAME",
            help="use this recipe (spec/recipes.md) whatever machine it was made on; `none`: no "
            "recipe [env: INFER_RECIPE]",
        )(f)
        f = click.option(
            "-v", "--verbose", is_flag=True, default=False, help="debug logging, and tracebacks on errors"
        )(f)
        return f

    return decorate


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate canonical option values from a verb's own arguments."""
    canon = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_NAMES}
    return canon, kwargs


def resolve_cli(
    kwargs: dict[str, Any], engine_defaults: dict[str, Any] | None = None, recipes: bool = False
) -> Any:
    """Flags (as click parsed them) -> Resolved options. Consumes the canonical keys of kwargs.
    `recipes`: the verb picks the best recipe by itself (run, chat, serve, config show); any
    verb uses the one --recipe or INFER_RECIPE names."""
    from stdengine.config import parse_engine_args, resolve

    canon, rest = split_kwargs(kwargs)
    if canon.get("engine_args"):
        canon["engine_args"] = parse_engine_args(canon["engine_args"])
    if rest.get("verbose"):
        canon["verbosity"] = max(1, canon.get("verbosity") or 0)
    ref = rest.get("recipe") or os.environ.get("INFER_RECIPE") or None
    return resolve(
        canon,
        config=rest.get("config_path"),
        engine_defaults=engine_defaults,
        recipes=recipes or ref is not None,
        recipe=ref,
    )


def make_emitter(options: Options, engine: str | None = None, model: str | None = None) -> Any:
    from stdengine.errors import UsageError
    from stdengine.events import Emitter

    try:
        return Emitter(
            log_format=options.log_format,
            verbosity=options.verbosity,
            log_file=options.log_file,
            engine=engine,
            model=model,
        )
    except OSError as e:  # a missing directory, a directory, no permission
        raise UsageError(
            f"cannot open the log file {options.log_file}: {e.strerror or e}",
            hint="give --log-file (or INFER_LOG_FILE) a path in an existing, writable directory",
        ) from e


def load(resolved: Any, events: Any) -> Any:
    """registry.load() with a command's resolved options: those the user set (flag, environment,
    config file) are the ones the engine must honour or refuse. Returns registry.Loaded."""
    from stdengine import registry

    if resolved.recipe is not None:
        report_recipe(resolved.recipe, events)
    return registry.load(resolved.options, events, resolved.explicitly_set())


def report_recipe(chosen: Any, events: Any) -> None:
    """The `recipe.applied` event (warn level when the recipe was made for another run)."""
    fields = chosen.event_fields()
    if chosen.warnings:
        events.warn("recipe.applied", **fields)
    else:
        events.info("recipe.applied", **fields)


def _verbose(argv: list[str]) -> bool:
    """-v, or INFER_VERBOSITY a positive number (a bad value is the config's error to report,
    without a traceback)."""
    level = os.environ.get("INFER_VERBOSITY", "").strip()
    return any(a in ("-v", "--verbose") for a in argv) or (level.isdigit() and int(level) > 0)


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def report_error(err: InferError, argv: list[str]) -> bool:
    """The `error` event (spec/events.md) of an error that ends a command: to --log-file, and on
    stderr with --log-format json. Returns True when stderr got it (as a JSON line), so the plain
    `error:` and `hint:` lines are not printed as well. An error raised before the command made
    its emitter (a bad flag or config file) finds the log settings in argv and the environment."""
    from stdengine.events import Emitter, last_emitter

    em = last_emitter()
    if em is None:
        fmt = _flag_value(argv, "--log-format") or os.environ.get("INFER_LOG_FORMAT") or "text"
        log_file = _flag_value(argv, "--log-file") or os.environ.get("INFER_LOG_FILE") or None
        if fmt != "json" and log_file is None:
            return False
        try:
            em = Emitter(log_format="json" if fmt == "json" else "text", log_file=log_file)
        except OSError:
            return False
        em.close()
    console = em.log_format == "json"
    try:
        em.error(err.to_dict(), console=console)
    except OSError:  # an unwritable log file must not hide the error itself
        return False
    return console


def run_cli(cmd: click.Command, argv: list[str], prog_name: str) -> None:
    """Run a click command; an InferError becomes one line (and a hint) and its exit status, and
    the `error` event in the log."""
    from stdengine.events import forget_emitters

    forget_emitters()
    try:
        cmd.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        from stdengine.errors import UsageError

        usage = UsageError(e.format_message(), hint=f"see `{prog_name} --help`")
        if not report_error(usage, argv):
            e.show()
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt) as e:
        if not report_error(Interrupted("interrupted"), argv):
            click.echo("\ninterrupted" if isinstance(e, KeyboardInterrupt) else "interrupted", err=True)
        sys.exit(Interrupted.exit_status)
    except InferError as e:
        if _verbose(argv):
            traceback.print_exc()
        if not report_error(e, argv):
            click.echo(f"error: {e.message}", err=True)
            if e.hint:
                click.echo(f"hint: {e.hint}", err=True)
        sys.exit(e.exit_status)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # a bug: one line unless -v
        if _verbose(argv):
            traceback.print_exc()
        bug = InferError(
            f"internal error: {type(e).__name__}: {e}", hint="rerun with -v for a traceback, and report it"
        )
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
            # the disk's fault, not a bug (`infer run > /dev/full`)
            bug = InferError(f"cannot write: {e.strerror}", hint="free some space, or write somewhere else")
        if not report_error(bug, argv):
            click.echo(f"error: {bug.message}", err=True)
            click.echo(f"hint: {bug.hint}", err=True)
        sys.exit(1)
    sys.exit(0)
