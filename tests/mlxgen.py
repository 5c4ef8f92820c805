"""A tiny MLX model made by the tests: random weights and a tokenizer built with `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    '{"name": "Alice", "age": 34, "city": "Paris", "tags": ["a", "b"], "ok": true, "score": 0.5}',
    "positive negative neutral spam ham sports politics technology business health",
    "The quick brown fox jumps over the lazy dog. Zoë, Łukasz and 王芳 met in Zürich.",
    "0123456789 -+.eE {}[]:,\" \\ null false true",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_mlx_model(out: Path, seed: int = 0, n_layers: int = 2) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML, "model_max_length": 2048}))
    config = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": n_layers, "intermediate_size": 256,
              "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
              "vocab_size": tok.get_vocab_size(), "tie_word_embeddings": True, "max_position_embeddings": 2048,
              "rope_theta": 10000.0, "eos_token_id": tok.token_to_id("<|im_end|>")}
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out
