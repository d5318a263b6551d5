"""The rules that relate a Config's fields: what the engine can run, each refusal naming the field and a fix.

`RULES` is the whole list, in the order they run; `check(cfg)` runs them.
A field's own type and range are checked before any rule (`refusals.py`),
and the model's shape by `ModelConfig` itself, so a rule may assume every
value is of its type and in its range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from workbench.config.degrees import divisors
from workbench.config.choices import FP8
from workbench.config.refusals import refuse
from workbench.config.tokenizer import tokenizer_info
from workbench.schedules import MULTI_STAGE, V_SHAPED, config_stages, splits_backward

if TYPE_CHECKING:
    from workbench.config.run import Config


def hsdp_splits_the_data_parallel_ranks(cfg: Config) -> None:
    """dp_replicate groups of dp/dp_replicate ranks each, sharded by FSDP2 within a group (before the degrees are
    made of it)."""
    r = cfg.dp_replicate
    if r == 1:
        return
    if cfg.zero < 2:
        raise refuse("dp_replicate", f"dp_replicate={r} is HSDP, which replicates FSDP2 shard groups; zero={cfg.zero} "
                     "already replicates everything over dp", "set zero=2 or 3, or dp_replicate=1")
    if cfg.dp % r:
        raise refuse("dp_replicate", f"dp_replicate={r} does not divide dp={cfg.dp}",
                     f"choose dp_replicate among {[d for d in divisors(cfg.dp) if d < cfg.dp]}")
    if r == cfg.dp:
        raise refuse("dp_replicate", f"dp_replicate=dp={r} leaves one rank per shard group: nothing to shard",
                     "use zero=0 (DDP) for pure replication, or a dp_replicate below dp")


def context_parallel_splits_sequences(cfg: Config) -> None:
    """cp cuts every sequence; a mixture of experts routes whole sequences (its routing group and capacity)."""
    if cfg.cp > 1 and cfg.model.n_experts:
        raise refuse("cp", f"cp={cfg.cp} splits each sequence across ranks, but a mixture of experts routes whole "
                     "sequences (its capacity and balancing loss are per sequence), so the split would change the model",
                     "set cp=1 with a mixture of experts, or use a dense model")


def degrees_fit_the_model(cfg: Config) -> None:
    """tp splits heads and the MLP, pp (times the interleaved stages) the layers, ep the experts, both the sequence."""
    cfg.degrees.check_model(cfg.model, config_stages(cfg))
    cfg.degrees.check_sequence(cfg.seq_len)


def v_schedule_splits_the_layers(cfg: Config) -> None:
    """ZBV and DualPipeV hold two stages per rank whatever stages_per_rank says: 2·pp stages cut the layers."""
    n_layers = cfg.model.n_layers
    if cfg.pp > 1 and cfg.schedule in V_SHAPED and n_layers % (2 * cfg.pp):
        fits = [p for p in range(2, n_layers // 2 + 1) if n_layers % (2 * p) == 0]
        raise refuse("pp", f"{cfg.schedule} holds 2 stages per rank (rank r: stages r and 2·pp-1-r), so "
                     f"2·pp = {2 * cfg.pp} stages must divide model.n_layers={n_layers}",
                     f"choose pp among {fits}" if fits else 'use more layers, or schedule="1f1b"')


def pipeline_has_enough_micro_batches(cfg: Config) -> None:
    if cfg.pp == 1:
        return
    m, pp = cfg.micro_batches, cfg.pp
    if cfg.schedule == "dualpipev" and m < 2 * pp:
        raise refuse("micro_batches", f"dualpipev needs at least as many micro-batches as stages "
                     f"(2·pp = {2 * pp}), got {m}", f"set micro_batches ≥ {2 * pp}")
    if cfg.schedule in ("1f1b", "interleaved_1f1b", "interleaved_zb") and m < pp:
        raise refuse("micro_batches", f"{cfg.schedule} needs at least pp={pp} micro-batches, got {m}",
                     f"set micro_batches ≥ {pp}")
    if cfg.schedule in MULTI_STAGE and m % pp:
        raise refuse("micro_batches", f"{cfg.schedule} needs micro_batches ({m}) to be a multiple of pp={pp}",
                     f"set micro_batches to a multiple of {pp}")


def split_backward_runs_eager(cfg: Config) -> None:
    """torch 2.13's zero-bubble schedules refuse compiled stages ("we dont support input/weight backward split with
    torch.compile"): a compiled block's backward is one fused kernel graph, with no input-gradient half to run alone."""
    if splits_backward(cfg) and cfg.compile:
        raise refuse("compile", f"compile=True with {cfg.schedule}: the split backward (I, then W) needs the eager "
                     "autograd graph, and a compiled block's backward is one fused graph",
                     "set compile=False, or schedule 1f1b/interleaved_1f1b")


def split_backward_has_its_data_parallel(cfg: Config) -> None:
    """What data parallel can run under a zero-bubble schedule in torch 2.13 (measured against one process)."""
    if not splits_backward(cfg) or cfg.dp * cfg.cp == 1:  # the cp ranks average gradients with the dp ranks
        return
    # Their weight-gradient half (W) runs autograd.grad over the parameters the input-gradient half (I) saw.
    if cfg.zero == 3:
        raise refuse("zero", f"zero=3 with {cfg.schedule}: the input-gradient half looks up the parameters "
                     "its graph used while FSDP2 holds each block resharded after forward, so the weight "
                     "gradients of the blocks are never computed",
                     "use zero=2 (gathered from forward to backward), or schedule 1f1b/interleaved_1f1b")
    if cfg.zero == 1:
        raise refuse("zero", f"zero=1 with {cfg.schedule}: the weight-gradient half writes gradients past DDP's "
                     "hooks, so data parallel runs as torch's replicate(), whose DTensor parameters "
                     "ZeroRedundancyOptimizer cannot update", "use zero=0 (replicate) or zero=2")
    if cfg.zero == 0 and cfg.compression != "none":
        raise refuse("compression", f"{cfg.compression!r} with zero=0 under {cfg.schedule}: data parallel runs "
                     "as torch's replicate(), which has no communication hook",
                     'use zero=2 with compression "fp16" or "bf16", or compression="none"')
    if cfg.zero == 0 and cfg.offload:
        raise refuse("offload", f"offload with zero=0 under {cfg.schedule}: data parallel runs as torch's "
                     "replicate(), whose DTensor parameters the host optimizer of zero 0/1 cannot hold",
                     "use zero=2 with offload, or offload=False")
    if cfg.zero == 0 and cfg.ep > 1:
        raise refuse("ep", f"ep={cfg.ep} with zero=0 under {cfg.schedule}: torch's replicate() would average "
                     "the expert slices over every dp rank, though they differ across ep ranks",
                     "use zero=2 (experts sharded over edp), or ep=1")


def batch_splits_and_sequence_fits(cfg: Config) -> None:
    if cfg.batch_size % (cfg.dp * cfg.micro_batches):
        raise refuse("batch_size", f"batch_size={cfg.batch_size} is not divisible by "
                     f"dp·micro_batches={cfg.dp}·{cfg.micro_batches}", f"use a multiple of {cfg.dp * cfg.micro_batches}")
    if cfg.seq_len > cfg.model.max_seq_len:
        raise refuse("seq_len", f"seq_len={cfg.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}",
                     f"use seq_len ≤ {cfg.model.max_seq_len}")


def zero_has_ranks_to_shard_over(cfg: Config) -> None:
    # The cp ranks hold the same weights and average their gradients with the dp ranks: ZeRO shards over dp·cp.
    if cfg.zero > 0 and cfg.dp * cfg.cp == 1:
        raise refuse("zero", f"ZeRO stage {cfg.zero} shards across data-parallel ranks, but dp=1",
                     "set dp ≥ 2 or zero=0")
    if cfg.zero == 1 and cfg.dp > 1 and cfg.tp > 1:
        # torch 2.13: ZeroRedundancyOptimizer broadcasts each updated parameter with c10d.broadcast,
        # which has no DTensor sharding rule, so its step fails on tensor-parallel parameters.
        raise refuse("zero", f"zero=1 (ZeroRedundancyOptimizer) cannot update tensor-parallel (DTensor) "
                     f"parameters (dp={cfg.dp}, tp={cfg.tp})",
                     "use zero=2 (FSDP2: optimizer state and gradients sharded), zero=0, or tp=1")
    if cfg.ep > 1 and cfg.zero == 1:
        # ZeroRedundancyOptimizer partitions parameters over all dp ranks and broadcasts each update from
        # its owner: expert slices differ across the ep ranks, so a broadcast would overwrite them.
        raise refuse("zero", f"zero=1 (ZeroRedundancyOptimizer over dp) cannot hold expert slices that "
                     f"differ across ep={cfg.ep} ranks", "use zero=0, 2 or 3 with ep > 1, or ep=1")


def hierarchical_exchange_has_experts(cfg: Config) -> None:
    if cfg.expert_exchange == "hierarchical" and cfg.ep == 1:
        raise refuse("expert_exchange", "the hierarchical exchange routes expert-parallel tokens, but ep=1 has none",
                     'set ep ≥ 2 (a mixture of experts split over ranks) or expert_exchange="flat"')


def compression_has_a_sync_to_compress(cfg: Config) -> None:
    kind = cfg.compression
    if kind != "none" and cfg.dp * cfg.cp == 1:
        raise refuse("compression", f"{kind!r} compresses the data-parallel gradient sync, but dp=1 has none",
                     'set dp ≥ 2 or compression="none"')
    if kind != "none" and cfg.tp > 1 and cfg.zero == 0:
        # With tp > 1, zero=0 is torch's FSDP2-based `replicate`, which takes no DDP comm hook.
        raise refuse("compression", f"{kind!r} with tp={cfg.tp} and zero=0: data parallel over tensor-parallel "
                     "(DTensor) parameters uses torch's replicate(), which has no communication hook",
                     'use zero=2 with compression "fp16" or "bf16", or tp=1')
    if kind in ("powersgd", "int8", "1bit") and cfg.zero >= 2:
        raise refuse("compression", f"{kind!r} needs DDP's comm hooks (zero 0/1); zero={cfg.zero} is FSDP2, "
                     "which reduce-scatters gradient shards and has no hook for a custom reduction in torch 2.13",
                     'use zero=0 or 1 for that compression, or "fp16"/"bf16" (FSDP2\'s reduce_dtype) with zero 2/3')


def offload_has_plain_parameters(cfg: Config) -> None:
    if cfg.offload and cfg.tp > 1:
        raise refuse("offload", f"offload with tp={cfg.tp} is not implemented here (the host optimizer of "
                     "zero 0/1 holds plain tensors, not tensor-parallel DTensors)", "set tp=1 or offload=False")


def fsdp_mixed_precision_has_its_setting(cfg: Config) -> None:
    if cfg.mixed_precision != "fsdp":
        return
    if cfg.zero < 2:
        raise refuse("mixed_precision", f"'fsdp' is FSDP2's MixedPrecisionPolicy, and zero={cfg.zero} is not "
                     "FSDP2", 'use zero=2 or 3, or mixed_precision="autocast"')
    if cfg.precision not in ("bf16", *FP8):
        # fp8 keeps bf16 beside its Float8 linears, as torchtitan runs Float8 under FSDP2's bf16 policy.
        raise refuse("mixed_precision", f"'fsdp' casts the parameters to bf16 for compute; precision="
                     f"{cfg.precision!r}", 'set precision="bf16" (or an fp8 one), or mixed_precision="autocast"')


def compile_settings_fit(cfg: Config) -> None:
    """CUDA Graphs are torch.compile's; they replay kernels on inputs that stay where they were captured."""
    if cfg.cuda_graphs and not cfg.compile:
        raise refuse("cuda_graphs", "CUDA Graphs here are torch.compile's mode=\"reduce-overhead\", and compile=False",
                     "set compile=True with cuda_graphs=True")
    if not cfg.cuda_graphs:
        return
    if cfg.compile_backend != "inductor":
        raise refuse("cuda_graphs", f"CUDA Graphs are inductor's (compile_backend={cfg.compile_backend!r})",
                     'set compile_backend="inductor"')
    if cfg.zero >= 2:
        raise refuse("cuda_graphs", f"zero={cfg.zero} is FSDP2, which gathers each block's parameters into new memory "
                     "every step: a captured graph would read the old addresses", "use zero=0 or 1, or cuda_graphs=False")
    if cfg.offload:
        raise refuse("cuda_graphs", "offload keeps the optimizer step on the host, outside any CUDA graph",
                     "set offload=False or cuda_graphs=False")
    if cfg.pp > 1 or cfg.model.n_experts:
        what = f"pp={cfg.pp}" if cfg.pp > 1 else "a mixture of experts (data-dependent routing)"
        raise refuse("cuda_graphs", f"CUDA Graphs with {what} are not checked in this workbench",
                     "use a dense model without a pipeline for cuda_graphs, or cuda_graphs=False")


def fp8_fits(cfg: Config) -> None:
    """torchao's Float8 linears: wired with FSDP2 and DDP, not with tensor parallel (which needs torchao's own
    Float8 styles) nor with offload."""
    if cfg.precision not in FP8:
        return
    if cfg.tp > 1:
        raise refuse("precision", f"{cfg.precision} with tp={cfg.tp}: tensor parallel fp8 needs torchao's Float8 "
                     "tensor-parallel styles, not wired here", "use tp=1 with fp8 (any zero stage), or bf16")
    if cfg.offload:
        raise refuse("precision", f"{cfg.precision} with offload is not wired here", "set offload=False, or bf16")


def replica_check_has_replicas(cfg: Config) -> None:
    """The replica check compares ranks that hold the same bytes: dp·cp ranks under zero 0/1, HSDP's replica groups
    (`workbench.telemetry.replicas.replica_group`)."""
    if not cfg.replica_check_every:
        return
    if cfg.zero >= 2 and cfg.dp_replicate == 1:
        raise refuse("replica_check_every", f"zero={cfg.zero} shards every parameter over the dp ranks, so no two "
                     "ranks hold the same bytes to compare", "use zero 0/1, HSDP (dp_replicate ≥ 2) or "
                     "replica_check_every=0")
    if cfg.dp * cfg.cp == 1:
        raise refuse("replica_check_every", "the layout has no data-parallel replicas to compare (dp·cp = 1)",
                     "set dp ≥ 2 or replica_check_every=0")


def tokenizer_fits_the_model(cfg: Config) -> None:
    """Every id the tokenizer produces must index the model's embedding: a larger vocabulary would fail at the
    first batch that holds one of the ids beyond it."""
    if cfg.tokenizer is None:
        return
    info = tokenizer_info(cfg.tokenizer)
    vocab = cfg.model.vocab_size
    if info.vocab_size > vocab:
        padded = -(-info.vocab_size // 64) * 64
        raise refuse("tokenizer", f"{info.path} produces ids up to {info.vocab_size - 1:,} ({info.vocab_size:,} "
                     f"tokens), more than model.vocab_size={vocab:,} embeds",
                     f"give the model vocab_size ≥ {info.vocab_size:,} (e.g. {padded:,}, a multiple of 64), or use a "
                     f"tokenizer of at most {vocab:,} tokens")


RULES: tuple[Callable[[Config], None], ...] = (
    tokenizer_fits_the_model,
    hsdp_splits_the_data_parallel_ranks,
    context_parallel_splits_sequences,
    v_schedule_splits_the_layers,
    degrees_fit_the_model,
    pipeline_has_enough_micro_batches,
    batch_splits_and_sequence_fits,
    zero_has_ranks_to_shard_over,
    split_backward_has_its_data_parallel,
    split_backward_runs_eager,
    compression_has_a_sync_to_compress,
    hierarchical_exchange_has_experts,
    offload_has_plain_parameters,
    fsdp_mixed_precision_has_its_setting,
    compile_settings_fit,
    fp8_fits,
    replica_check_has_replicas,
)
"""Every rule a Config passes, in order; a new field's rule is one more function here."""


def check(cfg: Config) -> None:
    """Raise the first refusal of `RULES` for `cfg`."""
    for rule in RULES:
        rule(cfg)
