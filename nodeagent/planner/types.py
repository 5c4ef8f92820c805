"""Typed values of the planner: what is asked, what is chosen, what it costs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nodeagent.kv_types import KvType
from nodeagent.values import Frozen as _Frozen

TaskType = Literal["extract", "classify", "chat", "embed", "rerank"]
BackendName = Literal["llamacpp", "mlx", "fake"]


class Requirements(_Frozen):
    """What the caller asks for. Fixed settings are honoured exactly; the rest is searched."""

    task: TaskType | None = None
    min_ctx_tokens: int | None = Field(None, gt=0, description="Context wanted; else the profile's default")
    slots: int | None = Field(None, gt=0)
    allow_ctx_over_trained: bool = False
    allow_ctx_over_profile: bool = Field(False, description="Allow a context past the device profile's maximum")
    # user-fixed settings: None means "choose for me"
    ctx_tokens: int | None = Field(None, gt=0)
    type_k: KvType | None = None
    type_v: KvType | None = None
    flash_attn: bool | None = None
    n_ubatch: int | None = Field(None, gt=0)
    n_batch: int | None = Field(None, gt=0)
    use_mmap: bool | None = None
    swa_full: bool | None = None
    n_gpu_layers: int | None = Field(None, ge=-1)
    n_threads: int | None = Field(None, gt=0)
    n_outputs_max: int = Field(1, gt=0, description="Logits rows per micro-batch the workload asks for "
                                                    "(1 for generation; label scoring asks for a few)")
    n_seq_max: int | None = Field(None, gt=0, le=256, description="Sequences in llama.cpp's unified KV cache; "
                                                                  "None: by task (label scoring batches branches)")


def ctx_per_slot(n_ctx: int, slots: int) -> int:
    """The context each of ``slots`` tasks gets: ``n_ctx`` is the cells of all of them together."""
    return n_ctx // slots


class Settings(_Frozen):
    """Exactly what the backend is given."""

    model_path: str
    n_ctx: int
    type_k: KvType
    type_v: KvType
    flash_attn: bool
    n_gpu_layers: int
    use_mmap: bool
    use_mlock: bool
    n_batch: int
    n_ubatch: int
    swa_full: bool
    n_threads: int
    slots: int
    n_outputs_max: int = Field(1, description="Logits rows per micro-batch the workload asks for")
    n_seq_max: int = Field(1, description="Sequences in one unified KV cache: each slot's, and for label "
                                          "scoring up to n_seq_max / slots - 1 label branches per slot; an "
                                          "embedding model's: the inputs one forward batch holds")
    pooling: str | None = Field(None, description="An embedding model's pooling (mean, cls, last, rank): llama.cpp "
                                                  "runs it in embedding mode; None: a generator")

    @property
    def ctx_per_slot(self) -> int:
        """The context each task gets: n_ctx is the cells of all slots together (an embedding model's tasks share
        its context: each input is read whole in one micro-batch, alone in its sequence)."""
        return self.n_ctx if self.pooling else ctx_per_slot(self.n_ctx, self.slots)


class Memory(_Frozen):
    """Predicted memory, in bytes. host_bytes + gpu_bytes == total_bytes."""

    weights_mapped_bytes: int = Field(description="Weights read through mmap (file-backed, reclaimable)")
    weights_anon_bytes: int = Field(description="Weights copied into anonymous memory: repacked tensors, "
                                                "or all CPU weights without mmap")
    weights_gpu_bytes: int = Field(0, description="Weights in GPU memory (Metal wraps the mapped file in place)")
    kv_bytes: int
    compute_bytes: int = Field(description="Compute buffers as llama.cpp reserves them")
    compute_resident_bytes: int = Field(description="The part of them the workload touches (logits for "
                                                    "n_outputs_max rows); host memory counts this, GPUs the reserve")
    output_bytes: int
    runtime_bytes: int = Field(description="What load and inference add outside llama.cpp's buffers")
    task_runtime_bytes: int = Field(0, description="The task runner's decoder state (llguidance's tokenizer, "
                                                   "grammars) and the logits each slot holds")
    overhead_bytes: int = Field(description="The process before any model is loaded")
    total_bytes: int
    host_bytes: int
    gpu_bytes: int


class Budget(_Frozen):
    kind: Literal["host-available", "metal-working-set", "gpu-free"]
    host_limit_bytes: int = Field(description="Host memory the plan may use: available RAM less the reserve")
    gpu_limit_bytes: int | None = Field(None, description="GPU memory the plan may use, where there is a GPU")
    ram_total_bytes: int
    reserve_bytes: int
    margin_bytes: int
    source: str = Field(description="Where the limit comes from")


class Plan(_Frozen):
    fits: bool
    backend: BackendName = Field(description="The backend that loads this plan")
    model: str = Field(description="Model file (path or URL)")
    quant: str | None
    profile: str
    settings: Settings
    memory: Memory
    budget: Budget
    reasons: list[str]
    draft_tokens: int = Field(0, ge=0, description="The longest draft from the input a decode step verifies (0: "
                                                  "none): what `nodeagent bench` measured pays here, or the setting")
    alternatives: list[str] = Field(default_factory=list, description="What would fit, when this does not")
