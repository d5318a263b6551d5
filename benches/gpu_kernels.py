"""The GPU model's kernel constants against this GPU: GEMMs by shape, flash attention, a streaming copy.

    python benches/gpu_kernels.py [--hardware h200] [--seq 8192]      # on a CUDA machine

For each kernel the estimator prices (workbench/estimate/kernels.py), prints its measured time, the time the
model gives it on the named profile, and their ratio (model / measured: below 1, the model is optimistic). The
shapes are Llama-3-8B's linears at a micro-batch of 2 × seq tokens, forward and backward's two GEMMs, and its
attention. Measured in the same run with CUDA events, after a warm-up; nothing here is asserted.
"""

from __future__ import annotations

import argparse

from workbench.estimate.kernels import attention_forward_flops, attention_time, gemm_time, memory_time
from workbench.hardware import profile


def _time(torch, fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: these are the GPU model's constants")
    hw, dev, bf16 = profile(args.hardware), "cuda", torch.bfloat16
    tokens, d, kv, f = 2 * args.seq, 4096, 1024, 14336
    print(f"{torch.cuda.get_device_name()} against profile {hw.name}; tokens {tokens}")
    print(f"{'kernel':<34}{'measured':>11}{'model':>11}{'model/measured':>16}")

    def row(name: str, measured: float, model: float) -> None:
        print(f"{name:<34}{measured * 1e3:>9.3f}ms{model * 1e3:>9.3f}ms{model / measured:>16.2f}")

    for name, (k, n) in {"wq/wo (4096→4096)": (d, d), "wk/wv (4096→1024)": (d, kv),
                         "w1/w3 (4096→14336)": (d, f), "w2 (14336→4096)": (f, d)}.items():
        x, w = torch.randn(tokens, k, device=dev, dtype=bf16), torch.randn(k, n, device=dev, dtype=bf16)
        g = torch.randn(tokens, n, device=dev, dtype=bf16)
        row(f"{name} forward", _time(torch, lambda: x @ w), gemm_time(hw, "bf16", tokens, n, k, 2))
        row(f"{name} input grad", _time(torch, lambda: g @ w.t()), gemm_time(hw, "bf16", tokens, k, n, 2))
        row(f"{name} weight grad", _time(torch, lambda: x.t() @ g), gemm_time(hw, "bf16", k, n, tokens, 2))

    heads, head_dim = 32, 128
    q = torch.randn(2, heads, args.seq, head_dim, device=dev, dtype=bf16, requires_grad=True)
    k_, v = (torch.randn(2, 8, args.seq, head_dim, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))

    def attention() -> None:
        out = F.scaled_dot_product_attention(q, k_, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    flops = attention_forward_flops(2 * args.seq, args.seq, heads, head_dim)
    row("flash attention fwd + bwd", _time(torch, attention, reps=5), attention_time(hw, "bf16", flops))
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    row("copy 1 GiB", _time(torch, lambda: dst.copy_(src)), memory_time(hw, 2 * src.numel()))


if __name__ == "__main__":
    main()
