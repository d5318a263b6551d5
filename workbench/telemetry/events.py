"""The small frozen records that cross from ranks to the notebook.

They hold plain Python numbers and strings only (no tensors), so the notebook
process never needs torch to read them and pickling them is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

IntervalKind = Literal["compute", "comm", "wait"]

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")
"""The keys of `StepMetrics.memory` and `peak_memory`, in the order plots stack them; the estimate predicts the
same ones (and communication buffers apart)."""


@dataclass(frozen=True, slots=True)
class Interval:
    """One timed span on one rank, in nanoseconds of the rank's monotonic clock."""

    kind: IntervalKind
    """"compute" (forward, backward, optimizer, pipeline action), "comm" (a collective), or "wait" (the
    calling thread blocked on a collective: not computing, even inside a compute span)."""
    name: str
    """What ran: "forward", "backward", "optimizer", "all_reduce", "all_gather", "send", ..."""
    start_ns: int
    end_ns: int
    bytes: int = 0
    """Payload of a collective in bytes as nccl-tests counts its size S: the whole buffer, i.e. the
    output of all_gather, the input of reduce_scatter and all_to_all, the one tensor otherwise; 0 for compute.
    `wb.estimate` predicts the same figure (`Collective.bytes`), and S times `analysis.bus_factor` as the
    bytes on a rank's link (`Collective.wire_bytes`)."""
    group_size: int = 1
    """Ranks taking part in the collective; 1 for compute."""
    stream: str = "main"
    """The thread or CUDA stream it ran on."""
    group: str = ""
    """Process group of a collective: its description (e.g. "mesh_dp") or name; "" for compute."""

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one rank reports for one optimizer step."""

    step: int
    """Index of the global batch this step trained on, counting from 0 across every apply() of a Workbench."""
    loss: float
    """Mean training loss of the global batch (identical on every rank)."""
    tokens: int
    """Tokens in the global batch of this step."""
    step_time_s: float
    """Wall time of the step on this rank, from batch fetch to optimizer done."""
    tokens_per_s: float
    """Global tokens per second: tokens / step_time_s."""
    rank: int = 0
    layout: str = ""
    """Short name of the layout that ran the step, e.g. "dp2·zero1"."""
    skipped: bool = False
    """True when the step was skipped on every rank (fp16 overflow, out of memory)."""
    skip_reason: str = ""
    loss_scale: float | None = None
    """fp16 dynamic loss scale after the step; None for other precisions."""
    aux_loss: float | None = None
    """Mixture of experts: the load-balancing loss of the global batch (summed over MoE layers, times
    aux_loss_coef), trained on beside `loss`, which excludes it; None for a dense model."""
    expert_load: tuple[tuple[int, ...], ...] = ()
    """Mixture of experts: the router's (token, expert) assignments in the global batch, per MoE layer × expert,
    dropped ones included (identical on every rank); () for a dense model."""
    tokens_dropped: tuple[int, ...] = ()
    """Mixture of experts: (token, expert) assignments dropped for lack of expert capacity in the global batch,
    per MoE layer (the token skips that expert; the residual carries it); () for a dense model."""
    # --- filled by telemetry probes (zero / empty when telemetry is off) ---
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes by category at the end of the step: parameters, gradients, optimizer, activations, other."""
    peak_memory: dict[str, int] = field(default_factory=dict)
    """Peak bytes by category during the step (activations peak mid-step)."""
    comm_time_s: float = 0.0
    """Union of all communication intervals of the step, in seconds."""
    exposed_comm_s: float = 0.0
    """Communication time during which no computation ran: what overlap failed to hide."""
    overlap: float | None = None
    """Fraction of communication time during which computation also ran; None without communication."""
    flops: float = 0.0
    """Model FLOPs of the step on this rank (forward + backward, from the model's formula)."""
    mfu: float | None = None
    """flops / step_time_s / peak FLOP/s of the device; None when the peak is unknown."""
    mfu_basis: str = ""
    """Where the peak behind `mfu` comes from: a datasheet, or a matmul peak measured on this rank."""
    intervals: tuple[Interval, ...] = ()
    """Every timed span of the step on this rank."""
    pipeline_actions: tuple[tuple[int, int, str, int, int], ...] = ()
    """(stage, micro-batch, "F"|"B", start_ns, end_ns) of each pipeline action this rank ran."""
    device_memory: dict[str, int] = field(default_factory=dict)
    """On CUDA, at the end of the step: "device_used"/"device_total" from cudaMemGetInfo (every process on the
    GPU, read by the compiled CUDA library) beside torch's allocator: "allocated", "reserved",
    "peak_allocated"; empty on CPU."""
    grad_sync_bytes: int = 0
    """Bytes this rank sent for the data-parallel gradient sync in the step (each recorded collective's size
    times its bus factor; `workbench.telemetry.grad_sync`); 0 with dp = 1 or telemetry off."""
    activations_step: int | None = None
    """The step whose forward `memory` and `peak_memory`'s "activations" were measured in: this one, or an earlier
    one of the same layout and batch shape. The meter watches a layout's first steps, then every tenth and any step
    whose batch shape changed (a dense layout at fixed shapes saves the same bytes every step); a mixture of
    experts' every step (`telemetry.activations.MeterSampling`). None with telemetry off or before a measurement."""
    dilation: float | None = None
    """Under an emulated cluster: the time dilation the step's collectives were paced with (its times divided
    by it are the cluster's); None when they were not paced (no cluster, or its dilation still being measured)."""


@dataclass(frozen=True, slots=True)
class CheckpointSave:
    """One checkpoint save on one rank, as a span on its clock (the same as `Interval`'s: `time.monotonic_ns`).

    A blocking save holds the training thread from `start_ns` to `durable_ns`; an asynchronous one only until
    `staged_ns` (its state copied to host memory), while the bytes are written in the background.
    """

    rank: int
    step: int
    """The data position the checkpoint resumes at (its directory is step-<step>)."""
    path: str
    asynchronous: bool
    start_ns: int
    staged_ns: int
    """When training could go on: the copy to host memory done (asynchronous), else = durable_ns."""
    durable_ns: int
    """When the save ended: committed (every chunk, the index, manifest and commit marker on disk), or failed."""
    bytes_written: int = 0
    """Chunk bytes this rank wrote: those the chunk store did not hold yet."""
    bytes_reused: int = 0
    """Chunk bytes this rank found in the store already (unchanged since an earlier checkpoint): not written."""
    error: str = ""
    """Why the save failed; "" when it committed."""


@dataclass(frozen=True, slots=True)
class Compilation:
    """One torch.compile compilation on one rank (Config.compile): sent when it starts (`end_ns` None: the status
    line shows it in progress) and again when it ends, on the rank's clock (`time.monotonic_ns`, as `Interval`)."""

    rank: int
    compile_id: str
    """Dynamo's id of the compiled frame ("0/0", "0/1": frame 0, its second variant after a recompile)."""
    trigger: str
    """"dynamo" (a forward traced and compiled), "lazy_backward" (its backward, at the first backward), or
    "cudagraph_recording" (CUDA Graphs captured)."""
    start_ns: int
    end_ns: int | None = None
