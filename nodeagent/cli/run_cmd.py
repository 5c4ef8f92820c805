"""`nodeagent run extract|classify`: one task from the shell, planned, loaded and validated."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from nodeagent.cli.common import App, json_option
from nodeagent.cli.plan_cmd import make_plan
from nodeagent.errors import NodeAgentError, UsageError
from nodeagent.output import print_json, print_table
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask, Result


class TaskError(NodeAgentError):
    """The task ran and failed: the Result says why."""

    exit_code = 12


def read_text(text: str | None, file: str | None) -> str:
    if text is not None and file is not None:
        raise UsageError("give the text with --text or --file, not both")
    if text is not None:
        return text
    if file is not None:
        try:
            data = Path(file).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {file}: {exc.strerror}") from None
        where = file
    else:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no input text", hint="pass --text, --file, or pipe the text on stdin")
        data = sys.stdin.buffer.read()
        where = "stdin"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where} is not valid UTF-8 (byte {exc.start}: {exc.reason})",
                         hint="convert the text to UTF-8 first") from None


def _task(build):  # type: ignore[no-untyped-def]
    try:
        return build()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"invalid task: {first['msg'].removeprefix('Value error, ')}"
                         + (f" ({where})" if where else "")) from None


def run_task(app: App, model: str, task, quant: str | None, ctx: int | None, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    from nodeagent.backends.llamacpp import LlamaCppBackend
    from nodeagent.tasks.runner import TaskRunner

    task_kind = "extract" if isinstance(task, ExtractTask) else "classify"
    if (Path(model) / "config.json").is_file():  # an mlx-lm directory
        return run_mlx(app, model, task, task_kind, ctx, as_json)
    plan = make_plan(app, model, None, quant, task=task_kind, ctx_tokens=ctx)
    if not plan.fits:
        raise UsageError(f"{model} does not fit this machine: {plan.reasons[-1]}",
                         hint="see 'nodeagent plan " + model + "'")
    if plan.model.startswith("hf://"):
        raise UsageError(f"{model} is not on this machine", hint=f"run 'nodeagent pull {model}' first")
    with LlamaCppBackend().load(plan) as loaded:
        runner = TaskRunner(loaded.session(), model=Path(plan.model).name, quant=plan.quant, backend="llamacpp")
        result = runner.run(task)
    show(result, as_json)
    if result.status != "ok":
        assert result.error is not None
        raise TaskError(f"task failed: {result.error.code}: {result.error.message}",
                        hint="retryable" if result.error.retryable else "not retryable")


def run_mlx(app: App, model: str, task, task_kind: str, ctx: int | None, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    from nodeagent.backends.mlx import MlxBackend, read_model_info
    from nodeagent.cli.plan_cmd import process_overhead_bytes
    from nodeagent.planner import Requirements
    from nodeagent.planner.mlx import plan_mlx
    from nodeagent.tasks.runner import TaskRunner

    info = read_model_info(model)
    plan = plan_mlx(info, app.hardware(), app.profile(), Requirements(task=task_kind, ctx_tokens=ctx),
                    overhead_bytes=process_overhead_bytes())
    if not plan.fits:
        raise UsageError(f"{model} does not fit this machine: {plan.reasons[-1]}")
    s = plan.settings
    with MlxBackend().load(model, n_ctx=s.n_ctx, kv_type=s.type_k, n_batch=s.n_batch) as loaded:
        result = TaskRunner(loaded.session(), model=Path(model).name, quant=plan.quant, backend="mlx").run(task)
    show(result, as_json)
    if result.status != "ok":
        assert result.error is not None
        raise TaskError(f"task failed: {result.error.code}: {result.error.message}")


def show(result: Result, as_json: bool) -> None:
    if as_json:
        print_json(result)
        return
    rows: list[tuple[str, object]] = [("task", f"{result.task_id} ({result.type})"), ("status", result.status)]
    if result.output is not None:
        out = result.output
        if hasattr(out, "probabilities"):
            rows.append(("label", out.label))
            if out.labels:
                rows.append(("labels", ", ".join(out.labels)))
            rows += [(f"p({k})", f"{v:.4f}") for k, v in sorted(out.probabilities.items(), key=lambda kv: -kv[1])]
        else:
            rows.append(("output", json.dumps(out, ensure_ascii=False)))
    if result.error:
        rows.append(("error", f"{result.error.code}: {result.error.message}"))
    t = result.timings
    rows += [("model", f"{result.model} ({result.quant}, {result.backend})"),
             ("tokens", f"{result.tokens.prompt} prompt, {result.tokens.generated} generated"),
             ("time", f"prompt {t.prompt_s:.3f}s, generation {t.generation_s:.3f}s, total {t.total_s:.3f}s")]
    rows += [("note", n) for n in result.notes]
    print_table(("field", "value"), rows, title="Result")


common = [
    click.option("--model", "model", required=True, help="Catalog name, .gguf file, or mlx-lm directory "
                                                         "(runs on MLX) on this machine."),
    click.option("--text", help="The input text."),
    click.option("--file", "file", type=click.Path(dir_okay=False), help="Read the input text from a file."),
    click.option("--instructions", help="Extra instructions for the model."),
    click.option("--quant", help="Which quant of a catalog model."),
    click.option("--ctx", "ctx", type=click.IntRange(min=64), help="Context length (default: planned)."),
    click.option("--id", "task_id", help="Task id (default: a new one)."),
]


def with_common(fn):  # type: ignore[no-untyped-def]
    for opt in reversed(common):
        fn = opt(fn)
    return fn


@click.group("run")
def command() -> None:
    """Run one typed task (extract.v1 or classify.v1) on a local model and print its Result."""


@command.command("extract")
@with_common
@click.option("--schema", "schema_file", required=True, type=click.Path(dir_okay=False),
              help="JSON Schema file of the object to extract.")
@json_option
@click.pass_obj
def extract(app: App, model: str, text: str | None, file: str | None, instructions: str | None, quant: str | None,
            ctx: int | None, task_id: str | None, schema_file: str, as_json: bool) -> None:
    """Extract an object matching --schema from the text (constrained decoding, then validation)."""
    try:
        schema = json.loads(Path(schema_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the schema {schema_file}: {exc}") from None
    source = read_text(text, file)
    extra = {"id": task_id} if task_id else {}
    task = _task(lambda: ExtractTask(input=source, schema=schema, instructions=instructions, **extra))
    run_task(app, model, task, quant, ctx, as_json)


@command.command("classify")
@with_common
@click.option("--labels", required=True, help="Comma-separated labels, e.g. positive,negative,neutral.")
@click.option("--multi-label", is_flag=True, help="Return every label at or above --threshold.")
@click.option("--threshold", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.5,
              show_default=True)
@json_option
@click.pass_obj
def classify(app: App, model: str, text: str | None, file: str | None, instructions: str | None,
             quant: str | None, ctx: int | None, task_id: str | None, labels: str, multi_label: bool,
             threshold: float, as_json: bool) -> None:
    """Classify the text into --labels by scoring each label from the model's logits."""
    names = [x for x in (p.strip() for p in labels.split(",")) if x] if labels.strip() else []
    source = read_text(text, file)
    extra = {"id": task_id} if task_id else {}
    task = _task(lambda: ClassifyTask(input=source, labels=names, multi_label=multi_label, threshold=threshold,
                                      instructions=instructions, **extra))
    run_task(app, model, task, quant, ctx, as_json)


@click.command("schema")
@click.argument("which", type=click.Choice(["task", "result"]))
def schema_command(which: str) -> None:
    """Print the JSON Schema of the task or result contract (for orchestrators in other languages)."""
    from nodeagent.tasks.contracts import result_json_schema, task_json_schema

    print_json(task_json_schema() if which == "task" else result_json_schema())
