"""The llama.cpp TokenSession over a loaded llama-cpp-python model."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class LlamaCppSession:
    def __init__(self, llama: Any) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llama = llama
        self.vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self.n_ctx = llama.n_ctx()
        self.n_vocab = llama.n_vocab()
        md = llama.metadata
        self.chat_template = md.get("tokenizer.chat_template") or None
        bos, eos = llama.token_bos(), llama.token_eos()
        self.bos_id = bos
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos_text = self._piece(bos) if bos >= 0 else ""
        self.eos_text = self._piece(eos) if eos >= 0 else ""
        eot = llama_cpp.llama_vocab_eot(self.vocab)
        self.end_of_turn = eot if eot >= 0 else eos
        self.eog_tokens = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)) \
            if self.n_vocab <= 300_000 else frozenset({eos, eot})
        self._ll = None
        self._tokens: list[int] = []  # what the KV cache holds

    def _piece(self, token: int) -> str:
        return self.llama.detokenize([token], special=True).decode("utf-8", "replace")

    def tokenize(self, text: str) -> list[int]:
        tokens = self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if self.add_bos and self.bos_id >= 0 and (not tokens or tokens[0] != self.bos_id):
            tokens = [self.bos_id] + tokens
        return tokens

    def tokenize_continuation(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def detokenize(self, tokens: list[int]) -> str:
        return self.llama.detokenize(tokens).decode("utf-8", "replace")

    def reset(self) -> None:
        self.llama.reset()
        self._tokens = []

    def truncate(self, n_tokens: int) -> None:
        # llama-cpp-python's eval() drops the KV cells from n_tokens on before it appends
        self.llama.n_tokens = n_tokens
        del self._tokens[n_tokens:]

    def prefill(self, tokens: list[int]) -> np.ndarray:
        from nodeagent.tasks.session import common_prefix

        keep = min(common_prefix(self._tokens, tokens), len(tokens) - 1)  # the last token is re-evaluated
        self.truncate(keep)
        return self.eval(tokens[keep:])

    def eval(self, tokens: list[int]) -> np.ndarray:
        self.llama.eval(tokens)
        self._tokens.extend(tokens)
        ptr = self._lib.llama_get_logits_ith(self.llama.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)).copy()

    def lltokenizer(self) -> Any:
        if self._ll is None:
            import warnings

            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it calls a deprecated llama.cpp accessor once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                self._ll = lltokenizer_from_vocab(self.vocab, eos_token=sorted(self.eog_tokens) or None)
        return self._ll
