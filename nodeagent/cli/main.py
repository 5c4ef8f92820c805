"""The `nodeagent` command."""

from __future__ import annotations

import os
import sys
import traceback

import click

from nodeagent import __version__
from nodeagent.cli.common import App, setup_logging
from nodeagent.config import env_rows
from nodeagent.config import load as load_config
from nodeagent.errors import BrokerError, NodeAgentError


class Group(click.Group):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Environment variables"):
            formatter.write_dl(env_rows())


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nodeagent")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Config file (TOML).")
@click.option("--profile", help="Plan for this device profile (its RAM, GPU, threads, slots and KV defaults) "
              "instead of the matched one.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="Log level on stderr.")
@click.option("--debug", is_flag=True, default=None, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None, profile: str | None, log_level: str | None,
        debug: bool | None) -> None:
    """nodeagent: probe this device, read model files, and fit models to the machine."""
    app = App(flags={"config_file": config_file, "profile": profile, "log_level": log_level, "debug": debug})
    ctx.obj = app
    setup_logging(app.config.log_level, app.config.log_format, app.config.access_log)


def _register() -> None:
    from nodeagent.cli import (
        batch_cmd,
        bench_cmd,
        broker_cmd,
        config_cmd,
        control_cmd,
        dlq_cmd,
        doctor_cmd,
        gateway_cmd,
        inspect_cmd,
        models_cmd,
        plan_cmd,
        probe_cmd,
        profiles_cmd,
        run_cmd,
        scheduler_cmd,
        serve_cmd,
        service_cmd,
        status_cmd,
        tasks_cmd,
        worker_cmd,
    )

    for module in (probe_cmd, inspect_cmd, plan_cmd, run_cmd, profiles_cmd, models_cmd, config_cmd, serve_cmd,
                   service_cmd, bench_cmd, doctor_cmd, gateway_cmd, broker_cmd):
        cli.add_command(module.command)
    cli.add_command(models_cmd.pull)
    cli.add_command(run_cmd.schema_command)
    cli.add_command(batch_cmd.batch)
    cli.add_command(scheduler_cmd.scheduler)
    cli.add_command(scheduler_cmd.schedule)
    for command in (worker_cmd.worker, tasks_cmd.submit, tasks_cmd.tasks, dlq_cmd.dlq, status_cmd.status,
                    control_cmd.node, control_cmd.queue):
        cli.add_command(command)


_register()


def _debug_wanted(argv: list[str]) -> bool:
    """Whether to show tracebacks: --debug, or NODEAGENT_DEBUG through the resolver (variable or config file).
    Decided before the command runs, so a bad setting elsewhere still gets its one-line error."""
    if "--debug" in argv:
        return True
    try:
        return load_config(env=dict(os.environ)).debug
    except NodeAgentError:
        return False


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_wanted(argv)
    try:
        cli.main(args=argv, prog_name="nodeagent", standalone_mode=False)
    except NodeAgentError as exc:
        _fail(exc, debug)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        msg = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        click.echo(f"error: {msg}", err=True)
        if ctx is not None:
            click.echo(f"hint: see '{ctx.command_path} --help'", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:
        from nodeagent.broker.open import broker_errors

        if not isinstance(exc, broker_errors()):
            raise
        _fail(BrokerError(f"the queue failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                          hint="check that the broker (NODEAGENT_BROKER) is up and reachable, then try again"), debug)


def _fail(exc: NodeAgentError, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    click.echo(f"error: {exc}", err=True)
    if exc.hint:
        click.echo(f"hint: {exc.hint}", err=True)
    sys.exit(exc.exit_code)
