"""The llama.cpp TokenSession over a loaded llama-cpp-python model."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from nodeagent.errors import BackendError


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
        self.eog_tokens = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t)) \
            if self.n_vocab <= 300_000 else frozenset({eos, eot})
        self._ll = None
        self._tokens: list[int] = []  # what the KV cache holds
        params = llama.context_params
        # branches run as sequences sharing the prompt's cells: that needs llama.cpp's unified KV cache
        self.n_seq_max = int(params.n_seq_max) if params.kv_unified else 1
        self.n_batch = int(params.n_batch)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

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

    def reset(self) -> None:
        self.llama.reset()
        self._tokens = []

    def truncate(self, n_tokens: int) -> None:
        # llama-cpp-python's eval() drops the KV cells from n_tokens on before it appends
        self.llama.n_tokens = n_tokens
        del self._tokens[n_tokens:]

    def prefill(self, tokens: list[int]) -> np.ndarray:
        from nodeagent.backends.session import common_prefix

        keep = min(common_prefix(self._tokens, tokens), len(tokens) - 1)  # the last token is re-evaluated
        self.truncate(keep)
        return self.eval(tokens[keep:])

    def eval(self, tokens: list[int]) -> np.ndarray:
        self.llama.eval(tokens)
        self._tokens.extend(tokens)
        ptr = self._lib.llama_get_logits_ith(self.llama.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)).copy()

    def eval_tree(self, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
        """Every branch of the tree in one llama_decode where the context has room for sequences: each
        leaf's path is a sequence that shares the prompt's KV cells (seq_cp costs no copy in a unified
        cache) and a node shared by several paths is one token in all their sequences. Batches hold at most
        n_seq_max nodes, so the output buffer llama.cpp reserved at load never grows."""
        from nodeagent.backends.session import eval_tree_sequential, tree_paths

        # each node takes a cell of its own: the cells left after the sequence bound a batch too
        cap = min(self.n_seq_max, self.n_batch, self.n_ctx - len(self._tokens))
        if self.n_seq_max <= 1 or len(tokens) <= 1 or cap < 2:
            return eval_tree_sequential(self, parents, tokens)
        paths = tree_paths(parents)
        inner = set(parents)
        leaves = [i for i in range(len(tokens)) if i not in inner]
        out: dict[int, np.ndarray] = {}
        chunk: list[int] = []
        for leaf in leaves + [-1]:  # -1 flushes the last chunk
            nodes = sorted({n for lf in chunk + ([leaf] if leaf >= 0 else []) for n in paths[lf]})
            if leaf >= 0 and len(chunk) < self.n_seq_max - 1 and len(nodes) <= cap:
                chunk.append(leaf)
                continue
            if chunk:
                out.update(self._decode_branches(chunk, paths, tokens))
            chunk = [leaf] if leaf >= 0 else []
            if leaf >= 0 and len(paths[leaf]) > cap:  # a branch longer than a batch: one node at a time
                sub = paths[leaf]
                logits = eval_tree_sequential(self, [-1] + list(range(len(sub) - 1)), [tokens[n] for n in sub])
                out.update(zip(sub, logits))
                chunk = []
        return [out[i] for i in range(len(tokens))]

    def _decode_branches(self, leaves: list[int], paths: list[list[int]], tokens: list[int]) -> dict[int, np.ndarray]:
        lib, ctx = self._lib, self.llama.ctx
        base = len(self._tokens)
        seqs_of: dict[int, list[int]] = {}
        for k, leaf in enumerate(leaves):
            for node in paths[leaf]:
                seqs_of.setdefault(node, []).append(k + 1)  # sequence 0 is the prompt
        nodes = sorted(seqs_of)
        mem = lib.llama_get_memory(ctx)
        lib.llama_memory_seq_rm(mem, -1, base, -1)
        for k in range(len(leaves)):
            lib.llama_memory_seq_cp(mem, 0, k + 1, 0, base)
        batch = lib.llama_batch_init(len(nodes), 0, len(leaves))
        try:
            batch.n_tokens = len(nodes)
            for j, node in enumerate(nodes):
                batch.token[j] = tokens[node]
                batch.pos[j] = base + len(paths[node]) - 1
                batch.n_seq_id[j] = len(seqs_of[node])
                for m, seq in enumerate(seqs_of[node]):
                    batch.seq_id[j][m] = seq
                batch.logits[j] = True
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise BackendError(f"llama_decode returned {rc} for a batch of {len(nodes)} branch tokens",
                                   hint="run with --log-level debug to see llama.cpp's log")
            out = {}
            for j, node in enumerate(nodes):
                ptr = lib.llama_get_logits_ith(ctx, j)
                out[node] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                  shape=(self.n_vocab,)).copy()
            return out
        finally:
            lib.llama_batch_free(batch)
            for k in range(len(leaves)):
                lib.llama_memory_seq_rm(mem, k + 1, -1, -1)

    def lltokenizer(self) -> Any:
        if self._ll is None:
            import warnings

            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it calls a deprecated llama.cpp accessor once per token
                warnings.simplefilter("ignore", DeprecationWarning)
                self._ll = lltokenizer_from_vocab(self.vocab, eos_token=sorted(self.eog_tokens) or None)
        return self._ll
