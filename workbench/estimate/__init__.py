"""Predicted memory, FLOPs, communication and step time of a `Config` on a hardware profile, from shapes alone.

Pure arithmetic with no torch import, so the notebook can re-run it on every widget change. Figures are per
rank; with pipeline parallelism every stage is estimated and the most loaded one reported. One module per
parallel axis or memory subject, as `engine/parallel/` has one per parallelism, each a set of pure functions over
one rank's frozen `Stage` shape; `predict.estimate` puts them together. Everything assumed is listed in
`ASSUMPTIONS` and printed with each estimate.
"""

from workbench.estimate.assumptions import ASSUMPTIONS, GPU_ASSUMPTIONS
from workbench.estimate.compression import quantized_bucket_bytes
from workbench.estimate.data_parallel import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
from workbench.estimate.model_state import (
    ENGINE_STATE_BYTES,
    OPTIMIZER_STATE_BYTES,
    ZERO_PAPER_STATE_BYTES,
    StateBytes,
    engine_state_bytes,
    model_state_memory,
    zero_paper_memory,
)
from workbench.estimate.options import Features
from workbench.estimate.predict import estimate, grad_sync_bytes_per_step
from workbench.estimate.records import Collective, Estimate, Memory, Role, StageEstimate
from workbench.flops import flops_per_token

__all__ = ["ASSUMPTIONS", "GPU_ASSUMPTIONS", "Collective", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES",
           "ENGINE_STATE_BYTES", "Estimate", "Features", "Memory", "OPTIMIZER_STATE_BYTES", "Role", "StageEstimate",
           "StateBytes", "ZERO_PAPER_STATE_BYTES", "engine_state_bytes", "estimate", "flops_per_token",
           "grad_sync_bytes_per_step", "model_state_memory", "quantized_bucket_bytes", "zero_paper_memory"]
