"""The llama.cpp vocabulary of a loaded llama-cpp-python model: tokenization, pieces, end-of-generation
tokens and the llguidance tokenizer. Decoding is the BatchEngine's (``llamacpp_batch``): its slots are the
TokenSessions, and they take these methods from here."""

from __future__ import annotations

from typing import Any


class LlamaCppVocab:
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
        self.eog_tokens = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)) \
            if self.n_vocab <= 300_000 else frozenset({eos, eot})
        self._ll = None
        self.n_batch = int(llama.context_params.n_batch)

    def _piece(self, token: int) -> str:
        return self.llama.detokenize([token], special=True).decode("utf-8", "replace")

    def tokenize(self, text: str) -> list[int]:
        tokens = self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if self.add_bos and self.bos_id >= 0 and (not tokens or tokens[0] != self.bos_id):
            tokens = [self.bos_id] + tokens
        return tokens

    def tokenize_continuation(self, text: str) -> list[int]:
        return self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def has_token(self, text: str) -> bool:
        return len(self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)) == 1

    def detokenize(self, tokens: list[int]) -> str:
        return self.llama.detokenize(tokens).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.llama.detokenize([token]))

    def lltokenizer(self) -> Any:
        if self._ll is None:
            import warnings

            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it calls a deprecated llama.cpp accessor once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                self._ll = lltokenizer_from_vocab(self.vocab, eos_token=sorted(self.eog_tokens) or None)
        return self._ll
