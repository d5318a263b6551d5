"""What estimating a model by tracing costs: one forward and backward on fake tensors per (model, sequence length,
precision), beside the formulas' estimate of the same Config, in one run.

    .venv/bin/python benches/trace.py

Prints, for the built-in tiny and 8b presets and Qwen3-8B's shape built by transformers, the first trace's time,
a cached call's, and the estimate's own time with and without the traced profile.
"""

from __future__ import annotations

import time

import workbench as wb
from workbench.tracing.estimate import traced_profile
from workbench.tracing.trace import trace


def _timed(fn, repeat: int = 1) -> tuple[float, object]:
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - start) / repeat, out


def main() -> None:
    for name, seq_len in (("tiny", 128), ("8b", 4096)):
        cfg = wb.Config(model=wb.ModelConfig.preset(name), seq_len=seq_len, batch_size=8, precision="bf16")
        first, p = _timed(lambda: traced_profile(cfg.model, seq_len, "low"))
        cached, _ = _timed(lambda: traced_profile(cfg.model, seq_len, "low"), 100)
        formulas, _ = _timed(lambda: wb.estimate(cfg, "h100", trace=False), 20)
        traced, _ = _timed(lambda: wb.estimate(cfg, "h100", trace=True), 20)
        print(f"{name:>5} seq {seq_len}: trace {first:6.2f} s ({p.params:,} parameters, {len(p.kinds)} kind(s) "
              f"of block); cached {cached * 1e6:.1f} us; estimate {formulas * 1e3:.1f} ms by the formulas, "
              f"{traced * 1e3:.1f} ms traced ({traced / formulas:.2f}x)")
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    first, p = _timed(lambda: trace(lambda: AutoModelForCausalLM.from_config(config), seq_len=4096, precision="low"))
    print(f"Qwen3-8B (transformers) seq 4096: trace {first:.2f} s, {p.params:,} parameters, {len(p.kinds)} kind(s)")


if __name__ == "__main__":
    main()
