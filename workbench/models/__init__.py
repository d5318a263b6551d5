"""The models the workbench trains, and the protocol the engine lays any of them out through.

Model code only: no process, no process group, no device mesh. The engine (on the ranks) and the notebook (its
checks, and the estimator's tracer, which builds a model on the meta device) both import it.

- `protocol.py`     the model protocol: a causal LM's parts (embedding, blocks, final norm, head), how one block is
                    called, positions, the tensor-parallel plan, experts, attention; `Unsupported` refusals.
- `transformer.py`  the built-in decoder (RMSNorm, rotary, SwiGLU, grouped-query attention, mixture of experts),
                    which implements the protocol itself.
- `huggingface.py`  any transformers decoder-only causal LM, adapted from its module tree and its config's plans.
- `custom.py`       a user's own module (`CustomModel`), its parts named or found.
- `adapt.py`        what both adapters share: the class swap that mixes the protocol in, parameters on meta.
- `build.py`        any model source on the meta device, and where its initial values come from.
- `init.py`         initial values one parameter at a time, cut to the piece a rank holds.
- `weights.py`      a checkpoint's safetensors: checked by their headers, read in pieces, written back.
- `tp.py`           what keeps a tp degree from splitting a model by its plan, module by module.
- `sdpa.py`         causal SDPA calls routed to another kernel (context parallel for a user's module).
- `check.py`        before any rank: `check_model(cfg)` refusals, `describe(source)` for the dashboard.
"""
