"""The stable error codes of a ``Result`` (``ErrorInfo.code``), each declared once: whether another attempt may
succeed, who caused it, and the HTTP status a door answers it with.

``fault`` says whose fault a failure is, which is what the guard's error rate may count:
- ``task``: the task itself (an input too long for the context, a schema the output cannot meet, a deadline
  already past): another node would fail it too, so it says nothing about this node's health;
- ``node``: this node (its model, its backend, its speed): the guard counts it;
- ``fleet``: the queue's own bookkeeping (a lease that expired or was lost, a drain): counted by nobody.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fault = Literal["task", "node", "fleet"]


@dataclass(frozen=True)
class Code:
    name: str
    retryable: bool
    fault: Fault
    http_status: int
    meaning: str
    param: str | None = None  # the request's field a door names with it


CODES: dict[str, Code] = {c.name: c for c in (
    Code("invalid_task", False, "task", 400, "the payload is not a valid task of its queue"),
    Code("invalid_request", False, "task", 400, "the request asks for what cannot be done as asked"),
    Code("input_too_large", False, "task", 413, "a field of the task is over NODEAGENT_MAX_INPUT_BYTES"),
    Code("input_too_long", False, "task", 400, "the prompt and the answer's room do not fit the context"),
    Code("wrong_model_kind", False, "task", 400, "the model is not of the kind the task needs (an embedding model "
                                                 "asked to generate, a generator asked to embed)", "model"),
    Code("dimensions_unsupported", False, "task", 400, "the model declares no Matryoshka size of that many "
                                                       "dimensions", "dimensions"),
    Code("max_tokens_too_small", False, "task", 400, "max_tokens cannot hold the shortest answer the request admits",
         "max_tokens"),
    Code("deadline_exceeded", False, "task", 408, "the task's deadline passed"),
    Code("schema_unsupported", False, "task", 400, "neither the decoder nor the validator can honour the schema"),
    Code("invalid_output", False, "task", 422, "the output failed its schema after decoding and one repair"),
    Code("output_truncated", False, "task", 422, "the object did not close within the context"),
    Code("duplicate_key", True, "task", 422, "the model kept writing a key its object already has"),
    Code("too_many_attempts", False, "task", 500, "the workers that took it kept stopping before finishing"),
    Code("timeout", False, "node", 408, "the task ran past its time limit"),
    Code("template_error", False, "node", 400, "the model's chat template failed on the messages"),
    Code("decoder_error", True, "node", 500, "the constrained decoder failed"),
    Code("backend_error", True, "node", 503, "the model failed under the task"),
    Code("worker_error", True, "node", 500, "the worker failed running the task"),
    Code("lease_expired", True, "fleet", 503, "the worker stopped renewing its lease (crashed or lost)"),
    Code("lease_lost", True, "fleet", 503, "the lease was lost or the task cancelled"),
    Code("draining", True, "fleet", 503, "the worker is stopping"),
    Code("not_resumable", False, "fleet", 503, "a stream's next attempt cannot continue from what was sent"),
    Code("model_unavailable", True, "fleet", 503, "the node could not make room to load the task's model in time"),
    Code("cancelled", False, "fleet", 499, "the client went away, or the task was cancelled"),
    Code("node_lost", True, "fleet", 503, "the node running the request was lost after its answer began: ask again"),
)}
UNKNOWN = Code("?", True, "node", 500, "an error code this version does not know")


def code(name: str) -> Code:
    return CODES.get(name, UNKNOWN)
