"""The notebook side of estimating any model: trace it once on fake tensors (`trace.py`; `kernels.py`, the CPU
kernels that fake tensors and FLOP counting do not describe; `probes.py`, what the model protocol is asked), where
its parts are (`parts.py`), and the estimate and plan of a Config whose model is not the built-in one
(`estimate.py`).

torch is imported here (never on the estimator's side, which reads the pure `workbench.model_profile` this makes).
"""
