"""Models of one's own beside the built-in model: step time and peak memory per rank, and what building costs.

1. Each tested Hugging Face family at dp=2 ZeRO-3, tp=2 and pp=2 (1F1B, 2 micro-batches), 2 CPU ranks: median
   step time over the timed steps and each rank's peak model memory while training (parameters, gradients,
   optimizer state and activations, as the ranks' probe measures them), beside the built-in
   model of the same shape in the same layout, measured in the same run; the ratio family / built-in. A Llama is
   the built-in model's math (the same shape, RMSNorm, rotary, SwiGLU, grouped-query attention): its target is
   ≤ 1.1× the built-in's step time. The others differ in what they compute (Qwen3's per-head norms, Gemma's
   scaled embedding and GeGLU, a mixture of experts' routing), so their ratio is the price of that, not only of
   the adapter. Beside them, the traced estimate of the family's step on this machine's CPU
   (`workbench.tracing.estimate`, issue 32's item 6): its step time and its peak model memory per rank (the same
   four categories, its highest rank), each with the measurement's ratio to it; "n/a" with the reason where it
   cannot price it.
2. What building costs a rank: the peak resident memory of building a trainer (after a warm-up build, in a
   fresh rank: `tests/engine/own_model_fns.build_memory`) over the bytes of the parameters the rank holds, for a
   model of ~270 M parameters (1 GiB in fp32) at dp=2 ZeRO-3, tp=2 and pp=2; target ≤ 1.2. A rank holding the
   whole model would read ≥ 2.

    .venv/bin/python benches/own_models.py [--steps 8] [--rounds 2] [--families llama,qwen3] [--skip-build]

Timings are medians of a few steps on a shared 2-core machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workbench as wb  # noqa: E402

SHAPE = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=704, max_seq_len=256)
"""The built-in model's shape; every family is built at the same one."""
HF_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                intermediate_size=704, max_position_embeddings=256, tie_word_embeddings=False)
RUN = dict(batch_size=8, seq_len=128)
LAYOUTS = {"dp2 zero3": dict(dp=2, zero=3), "tp2": dict(tp=2), "pp2 1f1b": dict(pp=2, micro_batches=2)}
FAMILIES = ("llama", "mistral", "qwen3", "gemma", "qwen3_moe")
EXPERTS = dict(n_experts=4, top_k=2)


def family(name: str) -> wb.HFModel:
    import transformers

    extra = {"qwen3": {"head_dim": 32}, "gemma": {"head_dim": 32},
             "qwen3_moe": {"head_dim": 32, "moe_intermediate_size": 704, "num_experts": 4,
                           "num_experts_per_tok": 2}}.get(name, {})
    return wb.HFModel(transformers.CONFIG_MAPPING[name](**{**HF_SHAPE, **extra}))


def builtin(moe: bool) -> wb.ModelConfig:
    # capacity_factor 4: no token dropped, as transformers' routing drops none
    return wb.ModelConfig(**SHAPE, **({**EXPERTS, "capacity_factor": 4.0, "aux_loss_coef": 0.0} if moe else {}))


def timed_steps(cfg: wb.Config, steps: int) -> dict:
    """On every rank: build (telemetry on), 3 warm-up steps, then `steps` timed ones; the median step time, and the
    highest peak of the step's memory as the rank's probe measures it by category (parameters, gradients, optimizer
    state, activations: what the model costs, not the process's libraries)."""
    from tests.engine.own_model_fns import data_of
    from workbench.engine.mesh import build_mesh
    from workbench.engine.trainer import Trainer
    from workbench.pool import rank

    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", data_of(cfg), telemetry=True)
        metrics = [trainer.step(i) for i in range(3 + steps)][3:]
        trainer.close()
    model_bytes = max(sum(v for k, v in m.peak_memory.items() if k != "other") for m in metrics)
    return {"step_s": statistics.median(m.step_time_s for m in metrics), "peak_bytes": model_bytes}


def traced_estimate(cfg: wb.Config, cpu) -> tuple[float, int] | str:
    """The traced estimate of `cfg` on this machine's CPU: its step time and the most model memory a rank holds
    (parameters and optimizer state at rest, gradients and activations at their peak: what `timed_steps` sums of
    the probe's), or "n/a" and the reason where the estimator cannot price it."""
    try:
        from workbench.compare import predicted_memory
        from workbench.tracing.estimate import estimate

        est = estimate(cfg, cpu)
        return est.step_time_s, max(sum(rank.values()) for rank in predicted_memory(est, cfg).values())
    except Exception as e:  # noqa: BLE001 - a column the estimator fills where it can
        return f"n/a ({type(e).__name__}: {str(e)[:50]})"


def compare(pool: wb.Pool, steps: int, rounds: int, families: list[str]) -> None:
    from workbench.hardware import cpu_for

    cpu = cpu_for(2)
    print(f"1. step time and peak model memory per rank, 2 CPU ranks, batch {RUN['batch_size']} x seq "
          f"{RUN['seq_len']}; each step time the lowest of {rounds} medians of {steps} steps, the built-in model "
          "and the family measured in turn")
    print(f"{'family':10} {'layout':10} {'step ms':>8} {'built-in':>9} {'ratio':>6} {'peak MiB':>9} {'built-in':>9} "
          f"{'ratio':>6} | traced estimate: {'step ms':>7} {'meas/est':>8} {'peak MiB':>9} {'meas/est':>8}")
    for layout, degrees in LAYOUTS.items():
        for name in families:
            pair = [wb.Config(model=builtin(name.endswith("moe")), **RUN, **degrees),
                    wb.Config(model=family(name), **RUN, **degrees)]
            runs = [[_measure(pool, cfg, steps) for cfg in pair] for _ in range(rounds)]
            base, ours = (min(r[i][0] for r in runs) for i in (0, 1))
            base_mem, ours_mem = runs[0][0][1], runs[0][1][1]
            traced = traced_estimate(pair[1], cpu)
            beside = (f"{traced[0] * 1e3:7.1f} {ours / traced[0]:8.2f} {traced[1] / 2**20:9.1f} "
                      f"{ours_mem / traced[1]:8.3f}") if isinstance(traced, tuple) else traced
            print(f"{name:10} {layout:10} {ours * 1e3:8.1f} {base * 1e3:9.1f} {ours / base:6.2f} "
                  f"{ours_mem / 2**20:9.1f} {base_mem / 2**20:9.1f} {ours_mem / base_mem:6.2f} | "
                  f"{'':17}{beside}")


def _measure(pool: wb.Pool, cfg: wb.Config, steps: int) -> tuple[float, int]:
    results = pool.run(timed_steps, cfg, steps)
    return max(r["step_s"] for r in results), max(r["peak_bytes"] for r in results)


def build_cost(pool: wb.Pool) -> None:
    from tests.engine.own_model_fns import build_memory

    big_builtin = wb.ModelConfig(dim=1024, n_layers=16, n_heads=16, vocab_size=256, ffn_dim=4096, max_seq_len=256)
    big_llama = wb.HFModel(__import__("transformers").LlamaConfig(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=256,
        intermediate_size=4096, max_position_embeddings=256, tie_word_embeddings=False))
    print("\n2. building: peak resident memory of a rank over the parameters it holds (target ≤ 1.2; whole model: ≥ 2)")
    for model in (big_builtin, big_llama):
        for layout, degrees in LAYOUTS.items():
            pool.restart()  # a fresh rank: no memory of an earlier build to reuse
            results = pool.run(build_memory, wb.Config(model=model, **RUN, **degrees))
            ratios = [r["peak_bytes"] / r["shard_bytes"] for r in results]
            print(f"{model.name[:24]:24} {layout:10} shard {results[0]['shard_bytes'] / 2**20:6.0f} MiB, peak "
                  + ", ".join(f"{r:.3f}" for r in ratios) + f"  (max {max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, e.g. llama")
    args = parser.parse_args()
    with wb.Pool(2, device="cpu", timeout_s=600, standby=False,
                 backend_setup="workbench.telemetry.comm:register") as pool:  # the probe's recording backend
        compare(pool, args.steps, args.rounds, args.families.split(","))
        if not args.skip_build:
            build_cost(pool)


if __name__ == "__main__":
    main()
