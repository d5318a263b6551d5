"""The models the workbench trains, and the protocol the engine lays any of them out through.

Model code only: no process, no process group, no device mesh. The engine (on the ranks) and the notebook's
estimator (which traces a model on the meta device) both import it.

- `protocol.py`     the model protocol: a causal LM's parts (embedding, blocks, final norm, head), how one block is
                    called, positions, the tensor-parallel plan, experts, attention; `Unsupported` refusals.
- `transformer.py`  the built-in decoder (RMSNorm, rotary, SwiGLU, grouped-query attention, mixture of experts),
                    which implements the protocol itself.
"""
