"""`nodeagent inspect FILE`: read a GGUF header (never the tensor data)."""

from __future__ import annotations

import click

from nodeagent.cli.common import App, json_option
from nodeagent.modelfile import inspect_file
from nodeagent.output import format_bytes, print_json, print_pairs


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=True))
@json_option
@click.pass_obj
def command(app: App, file: str, as_json: bool) -> None:
    """Read the header of a GGUF FILE: architecture, shapes, quant and tensor bytes."""
    info = inspect_file(file)
    if as_json:
        print_json(info)
        return
    kv = info.head_count_kv
    kv_text = str(kv[0]) if len(set(kv)) == 1 else f"per layer: {kv}"
    rows = [
        ("file", f"{info.source} ({format_bytes(info.file_size_bytes)}"
                 f"{'' if info.is_complete else ', header only: tensor data missing'})"),
        ("architecture", info.architecture), ("name", info.name), ("size label", info.size_label),
        ("quant", f"{info.quant} (file type {info.file_type}), {info.bits_per_weight:.2f} bits per weight"),
        ("parameters", f"{info.n_params:,}"),
        ("blocks", info.block_count), ("embedding", info.embedding_length),
        ("attention heads", info.head_count), ("kv heads", kv_text),
        ("head size k/v", f"{info.key_length}/{info.value_length}"),
        ("sliding window", f"{info.sliding_window} tokens on {sum(info.swa_layers or [])} of {info.block_count} layers"
         if info.sliding_window else "none"),
        ("trained context", info.context_length), ("vocabulary", f"{info.vocab_size:,}"),
        ("experts", f"{info.expert_used_count} of {info.expert_count}" if info.expert_count else None),
        ("tensor bytes", f"{info.tensor_bytes:,} ({format_bytes(info.tensor_bytes)}) in {info.n_tensors} tensors"),
        ("by type", ", ".join(f"{t} {format_bytes(b)}" for t, b in info.tensor_bytes_by_type.items())),
        ("token embedding", f"{format_bytes(info.token_embd_bytes)} ({info.token_embd_type})"),
        ("output", "tied to the token embedding" if info.tied_embeddings
         else f"{format_bytes(info.output_bytes)} ({info.output_type})"),
        ("per block", f"{format_bytes(min(info.block_tensor_bytes))} - {format_bytes(max(info.block_tensor_bytes))}"
         if info.block_tensor_bytes else None),
        ("tokenizer", info.tokenizer_model), ("chat template", "yes" if info.has_chat_template else "no"),
    ]
    print_pairs(rows, title="GGUF header")
