"""The ``dsedge`` command. Subcommands are imported only when used, so ``inspect``, ``doctor``, ``targets`` and
``bench`` work on a device without torch, and a missing toolchain extra is reported for ``build`` alone."""
from __future__ import annotations

import importlib
import sys

import click

from .runtime.errors import DsedgeError
from .runtime.storage import storage_error

# name → "module:attribute". Device-side commands live in dsedge.commands, host-side ones in dsedge.toolchain.commands.
COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("dsedge.toolchain.commands.build:build", "Export, compress, validate and bundle a model for a target."),
    "quantize": ("dsedge.toolchain.commands.quantize:quantize", "Quantize an ONNX model (INT4/INT8/FP16)."),
    "prune": ("dsedge.toolchain.commands.prune:prune", "Prune a model (channels, 2:4)."),
    "train": ("dsedge.toolchain.commands.train:train", "Train a model from a config (torchrun-ready)."),
    "distill": ("dsedge.toolchain.commands.distill:distill", "Distill a student from a teacher (torchrun-ready)."),
    "inspect": ("dsedge.commands.inspect:inspect",
                "Check a bundle's manifest, hashes and signature; show its variants and providers."),
    "doctor": ("dsedge.commands.doctor:doctor", "Show the backends, providers and GPUs this machine has."),
    "targets": ("dsedge.commands.targets:targets", "List target profiles, or show one."),
    "bench": ("dsedge.commands.bench:bench", "Measure a bundle's latency and check it against its budget."),
    "verify": ("dsedge.commands.verify:verify", "Check this machine's backend against the bundle's golden I/O."),
    "keygen": ("dsedge.commands.signing:keygen", "Make an Ed25519 key pair for signing bundles."),
    "sign": ("dsedge.commands.signing:sign", "Sign a bundle's manifest (detached Ed25519 signature)."),
    "data": ("dsedge.toolchain.datacheck.cli:data", "Check a training data set's quality (data check DATA)."),
    "export": ("dsedge.toolchain.commands.export:export", "Export a bundle for another serving stack (Triton)."),
    "serve": ("dsedge.commands.serve:serve", "Serve bundles over KServe v2 / Triton's protocol (HTTP and gRPC)."),
}


def _set_verbosity(ctx: click.Context, param: click.Parameter, value: int) -> None:
    if value:
        ctx.meta["dsedge.verbosity"] = ctx.meta.get("dsedge.verbosity", 0) + (value if param.name == "verbose"
                                                                               else -value)
    if param.name == "quiet":  # the last of the two: configure once both are counted
        from .runtime.log_setup import configure_cli_logging

        configure_cli_logging(ctx.meta.get("dsedge.verbosity", 0))


def with_verbosity(command: click.Command) -> click.Command:
    """Add ``-v/--verbose`` (repeatable) and ``-q/--quiet`` to a command, and to each subcommand of a group
    (``dsedge export triton -q`` as ``dsedge export -q triton``); the level is in ``ctx.meta["dsedge.verbosity"]``
    (-1 quiet, 0 default, 1+ verbose)."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_verbosity(sub)
    if not any(p.name == "verbose" for p in command.params):
        command.params += [
            click.Option(["-v", "--verbose"], count=True, expose_value=False, is_eager=True, callback=_set_verbosity,
                         help="More output: -v info and third-party warnings, -vv debug (stage timings)."),
            click.Option(["-q", "--quiet"], count=True, expose_value=False, callback=_set_verbosity,
                         help="Errors and the result only: no progress display or step lines."),
        ]
    return command


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, help_text = COMMANDS[name]
        module, attr = target.split(":")
        try:
            return with_verbosity(getattr(importlib.import_module(module), attr))
        except ModuleNotFoundError as e:
            missing = e.name or "?"
            if missing.startswith("dsedge"):
                msg, hint = f"`dsedge {name}` is not available in this version", "see `dsedge --help`"
            else:
                msg = f"`dsedge {name}` needs the Python package {missing!r}, which is not installed"
                hint = 'install the host-side extra: pip install torch==2.13.0 "dsedge[toolchain]"'

            @click.command(name=name, help=help_text, context_settings={"ignore_unknown_options": True})
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def unavailable(args: tuple[str, ...]) -> None:
                raise DsedgeError(msg, hint)

            return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dsedge", prog_name="dsedge")
def cli() -> None:
    """dsedge: build deployable bundles per target (Jetson, T4, A100, CPU) and run them with latency budgets."""


def report_error(err: DsedgeError) -> None:
    """Print a user error as one line (plus its hint) on stderr, no traceback."""
    click.secho(f"error: {err}", fg="red", err=True)
    if err.hint:
        click.echo(f"  hint: {err.hint}", err=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is: it unwinds like Ctrl-C (temporary directories are removed, the train
    launcher passes it on to torchrun), and the command then exits 128 + 15 = 143, the status a shell, torchrun or a
    job scheduler reads as "ended by SIGTERM" (Ctrl-C: 130)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _exit_interrupted(err: BaseException, word: str) -> None:
    """Exit 143 ("terminated") when ``err`` is, or click's Abort was raised from, a SIGTERM; else ``word``, 130."""
    import signal

    if isinstance(err, Terminated) or isinstance(err.__cause__, Terminated):
        click.echo("terminated (SIGTERM)", err=True)
        sys.exit(128 + signal.SIGTERM)
    click.echo(word, err=True)
    sys.exit(130)


def _command_name(argv: list) -> str:
    """``"dsedge sign"``, ``"dsedge data check"``: the (sub)command ``argv`` runs, for an error's first words."""
    words = [str(a) for a in argv if not str(a).startswith("-")]
    group = cli.get_command(click.Context(cli), words[0]) if words and words[0] in COMMANDS else None
    return " ".join(["dsedge", *words[:2 if isinstance(group, click.Group) else 1]])


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors exit non-zero with one line and a hint; usage errors exit 2."""
    import signal

    try:
        signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (embedded use): keep the default
        pass
    try:
        rv = cli.main(args=argv, prog_name="dsedge", standalone_mode=False)
    except DsedgeError as e:
        report_error(e)
        sys.exit(e.exit_code)
    except OSError as e:  # a full disk, a quota, a read-only --out: one line, no traceback
        err = storage_error(e, _command_name(sys.argv[1:] if argv is None else argv))  # "dsedge sign failed: …"
        if err is None:
            raise
        report_error(err)
        sys.exit(err.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort as e:  # click turns a KeyboardInterrupt (and so a SIGTERM) into Abort
        _exit_interrupted(e, "aborted")
    except KeyboardInterrupt as e:
        _exit_interrupted(e, "interrupted")
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
