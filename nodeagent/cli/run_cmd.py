"""`nodeagent run extract|classify|embed`: one task from the shell, planned, loaded and validated."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from nodeagent.cli.common import PLANNER_FLAGS, App, json_option, options, setting_options, task_input_options
from nodeagent.errors import InputError, TaskFailed, UsageError
from nodeagent.node import make_task, read_input
from nodeagent.output import print_json, print_table
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import Result


def read_text(app: App, text: str | None, file: str | None) -> str:
    """The input from --text, --file or stdin; a file or stdin is read only up to the input limit."""
    limit = app.config.max_input_bytes
    if text is not None and file is not None:
        raise UsageError("give the text with --text or --file, not both")
    if text is not None:
        return read_input(text, None, "--text", limit)
    if file is not None:
        try:
            with open(file, "rb") as fh:
                data = fh.read(limit + 1)
        except OSError as exc:
            raise UsageError(f"cannot read {file}: {exc.strerror}") from None
        return read_input(None, data, file, limit)
    if sys.stdin is None or sys.stdin.isatty():
        raise InputError("no input text", hint="pass --text, --file, or pipe the text on stdin")
    return read_input(None, sys.stdin.buffer.read(limit + 1), "stdin", limit)


def run_task(app: App, model: str, task: Any, quant: str | None, as_json: bool, settings: dict[str, Any]) -> None:
    node = app.node(model, task=registry.of(task).role, quant=quant, **settings)
    node = node.sized_for(task) or node  # a one-shot run's context fits its task
    with node:
        result = node.run(task)
    show(result, as_json)
    if result.status != "ok":
        assert result.error is not None
        raise TaskFailed(result.error.code, f"task failed: {result.error.code}: {result.error.message}",
                         result.error.retryable,
                         hint="retryable" if result.error.retryable else "not retryable")


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
        elif hasattr(out, "embeddings"):
            rows.append(("vectors", f"{len(out.embeddings)} of {out.dimensions} values"))
            rows += [(f"input {i}", f"{n} tokens: " + ", ".join(f"{x:.4f}" for x in v[:4]) + ", ...")
                     for i, (n, v) in enumerate(zip(out.tokens, out.vectors()))]
        elif hasattr(out, "results"):
            rows += [(f"document {r.index}", f"{r.relevance_score:.4f}") for r in out.results]
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


run_options = options(
    click.option("--model", "model", required=True, help="Catalog name, .gguf file, or mlx-lm directory "
                                                         "(runs on MLX) on this machine."),
    *task_input_options,
    click.option("--quant", help="Which quant of a catalog model."),
    setting_options(*PLANNER_FLAGS),
)


@click.group("run")
def command() -> None:
    """Run one typed task (extract.v1, classify.v1, embed.v1 on an embedding model, rerank.v1) on a local model and
    print its Result."""


@command.command("extract")
@run_options
@click.option("--schema", "schema_file", required=True, type=click.Path(dir_okay=False),
              help="JSON Schema file of the object to extract.")
@click.option("--prompt", "prompt_form", type=click.Choice(["schema", "fields", "none"]),
              help="How the prompt states the fields: the JSON Schema, a line per field, or not at all (default: "
                   "the task's; docs/typed-tasks.md).")
@click.option("--copy", "copy_mode", type=click.Choice(["auto", "all", "none"]),
              help="Which string fields must be spans of the text (default: the task's; docs/typed-tasks.md).")
@json_option
@click.pass_obj
def extract(app: App, model: str, text: str | None, file: str | None, instructions: str | None, quant: str | None,
            task_id: str | None, schema_file: str, prompt_form: str | None, copy_mode: str | None, as_json: bool,
            **settings: Any) -> None:
    """Extract an object matching --schema from the text (constrained decoding, then validation)."""
    try:
        schema = json.loads(Path(schema_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the schema {schema_file}: {exc}") from None
    task = make_task("extract", input=read_text(app, text, file), schema=schema, instructions=instructions,
                     id=task_id, prompt=prompt_form, copy=copy_mode)
    run_task(app, model, task, quant, as_json, settings)


def classify_options(f: Any) -> Any:
    """The classification task's own options (`run classify` and `submit classify`)."""
    for option in reversed([
        click.option("--labels", required=True, help="Comma-separated labels, e.g. positive,negative,neutral."),
        click.option("--multi-label", is_flag=True, help="Return every label at or above --threshold."),
        click.option("--threshold", help="Multi-label: a probability above 0 and below 1, or auto "
                                         "(default: the task's, auto: 1 / K of K labels)."),
        click.option("--calibrate", type=click.Choice(["auto", "true", "false"]),
                     help="Contextual calibration against content-free inputs (default: the task's, auto)."),
        click.option("--answer", type=click.Choice(["json", "label"]),
                     help="Score the labels as the JSON route's answer or as the bare label (default: the task's)."),
        click.option("--length-norm", is_flag=True, help="Mean log-probability per label token, not the sum."),
        click.option("--examples", "examples_file", type=click.Path(dir_okay=False),
                     help="A JSON file of worked examples: [{\"text\": ..., \"label\": ...}, ...]."),
    ]):
        f = option(f)
    return f


def classify_fields(labels: str, multi_label: bool, threshold: str | None, calibrate: str | None, answer: str | None,
                    length_norm: bool, examples_file: str | None) -> dict[str, Any]:
    """The classify task's fields from classify_options' values (an option not given keeps the contract's
    default)."""
    names = [x for x in (p.strip() for p in labels.split(",")) if x] if labels.strip() else []
    examples: Any = []
    if examples_file:
        try:
            examples = json.loads(Path(examples_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read the examples {examples_file}: {exc}") from None
    fields: dict[str, Any] = {"labels": names, "multi_label": multi_label, "examples": examples}
    if threshold is not None:
        fields["threshold"] = threshold  # the contract parses it (a number or auto) and says what is wrong
    if answer is not None:
        fields["answer"] = answer
    if calibrate is not None:
        fields["calibrate"] = calibrate if calibrate == "auto" else calibrate == "true"
    if length_norm:
        fields["length_norm"] = True
    return fields


@command.command("classify")
@run_options
@classify_options
@json_option
@click.pass_obj
def classify(app: App, model: str, text: str | None, file: str | None, instructions: str | None,
             quant: str | None, task_id: str | None, labels: str, multi_label: bool, threshold: str | None,
             calibrate: str | None, answer: str | None, length_norm: bool, examples_file: str | None, as_json: bool,
             **settings: Any) -> None:
    """Classify the text into --labels by scoring each label from the model's logits."""
    task = make_task("classify", input=read_text(app, text, file), instructions=instructions, id=task_id,
                     **classify_fields(labels, multi_label, threshold, calibrate, answer, length_norm, examples_file))
    run_task(app, model, task, quant, as_json, settings)


@command.command("embed")
@run_options
@click.option("--dimensions", type=click.IntRange(min=1), help="Cut each vector to this Matryoshka size (only a "
                                                               "size the model declares).")
@json_option
@click.pass_obj
def embed(app: App, model: str, text: str | None, file: str | None, instructions: str | None, quant: str | None,
          task_id: str | None, dimensions: int | None, as_json: bool, **settings: Any) -> None:
    """A vector for each line of the text (embed.v1 on an embedding model); --json prints the Result, its vectors
    base64 of little-endian float32."""
    if instructions:
        raise UsageError("--instructions: an embedding model reads no instructions", hint="drop --instructions")
    lines = [x for x in read_text(app, text, file).splitlines() if x.strip()]
    task = make_task("embed", input=lines, dimensions=dimensions, id=task_id)
    run_task(app, model, task, quant, as_json, settings)


@command.command("rerank")
@run_options
@click.option("--query", required=True, help="What the documents (the text's lines) are ranked against.")
@click.option("--top-n", "top_n", type=click.IntRange(min=1), help="Only the N most relevant.")
@json_option
@click.pass_obj
def rerank(app: App, model: str, text: str | None, file: str | None, instructions: str | None, quant: str | None,
           task_id: str | None, query: str, top_n: int | None, as_json: bool, **settings: Any) -> None:
    """Score each line of the text against --query, most relevant first (rerank.v1 on a reranker, or on a model
    that generates: --instructions then says what relevance means)."""
    lines = [x for x in read_text(app, text, file).splitlines() if x.strip()]
    task = make_task("rerank", query=query, documents=lines, top_n=top_n, instruction=instructions, id=task_id)
    run_task(app, model, task, quant, as_json, settings)


@click.command("schema")
@click.argument("which", type=click.Choice(["task", "result", "envelope", "assignment", "lease", "demand"]))
def schema_command(which: str) -> None:
    """Print the JSON Schema of the task or result contract, of the queue's envelope, or of the scheduler's
    assignment, leader lease and demand figures (for tools in other languages; schemas/redis-contract.md and
    schemas/scheduler-contract.md say where they are kept)."""
    from nodeagent.broker.base import envelope_json_schema
    from nodeagent.fleet.scheduler import contract_schemas
    from nodeagent.tasks.contracts import result_json_schema, task_json_schema

    known = {"task": task_json_schema, "result": result_json_schema, "envelope": envelope_json_schema}
    print_json(known[which]() if which in known else contract_schemas()[which])
