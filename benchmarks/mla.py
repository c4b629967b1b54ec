"""MLA attention on the GPU, in the expanded layout both VeXact drivers use (``vexact_models/layers/mla.py``): per
head a key of ``qk_nope + qk_rope`` (192) and a value of ``v_head_dim`` (128), at the real per-layer shapes of
Moonlight-16B-A3B (16 heads) or DeepSeek-V3 (128 heads). Writes a markdown report to ``--out``:

- KV bytes per token (per layer and per model): the expanded cache vs the latent one (``kv_lora_rank + qk_rope``);
- decode: one new token per sequence over a paged cache (page 16, pages shuffled), batch 1/16/64/256, contexts
  1k-16k, in a CUDA graph as the engine runs it; time vs the bytes-over-bandwidth bound (K/V bytes read / the
  measured device-to-device copy bandwidth), and the bound a latent cache would have;
- prefill: causal forward and forward + backward of the packed (training) op vs ``scaled_dot_product_attention``
  (the best backend torch picks among flash / efficient / cuDNN) on the same expanded K/V.

Usage (GPU machine): ``source scripts/staging/device_env.sh && python benchmarks/mla.py --out $OUT/mla-h100.md
[--shape deepseek-v3]``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
from pathlib import Path

import hardware
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

import vexact_kernels as vk
from vexact_models import DEEPSEEK_V3_SHAPES, tiny_deepseek_v3_config

PAGE = 16
DEV = "cuda"
BF16 = 2  # bytes
SHAPES = {"moonlight": "moonlight-16b-a3b", "deepseek-v3": "deepseek-v3"}


def decode_case(cfg, batch: int, ctx: int):
    h, dk, dv = cfg.kv_cache_dims
    pages_per_seq = ctx // PAGE
    num_pages = batch * pages_per_seq
    kc = torch.randn(num_pages, PAGE, h, dk, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn(num_pages, PAGE, h, dv, device=DEV, dtype=torch.bfloat16)
    bt = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, pages_per_seq)
    q = torch.randn(batch, h, dk, device=DEV, dtype=torch.bfloat16)
    ctx_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    scale = cfg.softmax_scale
    fn = lambda: vk.attention_paged(q, kc, vc, bt, ctx_lens, cu, scale)  # noqa: E731
    fn()
    ms = do_bench_cudagraph(fn, rep=50)
    nbytes = (kc.numel() + vc.numel()) * BF16 + q.numel() * BF16 + batch * h * dv * BF16
    return ms, nbytes


def _packed(cfg, batch: int, seqlen: int, grad: bool):
    h, dk, dv = cfg.kv_cache_dims
    t = batch * seqlen
    q = torch.randn(t, h, dk, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(t, h, dk, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(t, h, dv, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    cu = torch.arange(0, t + 1, seqlen, device=DEV, dtype=torch.int32)
    return q, k, v, cu


def _bhld(x, batch, seqlen):
    return x.detach().view(batch, seqlen, *x.shape[1:]).transpose(1, 2).contiguous().requires_grad_(x.requires_grad)


def causal_flops(cfg, batch: int, seqlen: int) -> float:
    h, dk, dv = cfg.kv_cache_dims
    return 2 * batch * seqlen * seqlen / 2 * h * (dk + dv)  # QK^T and PV, half the square


SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def prefill_case(cfg, batch: int, seqlen: int):
    """(ours fwd ms, sdpa fwd ms, ours fwd+bwd ms, sdpa fwd+bwd ms)."""
    scale = cfg.softmax_scale
    q, k, v, cu = _packed(cfg, batch, seqlen, grad=True)
    do = torch.randn(q.shape[0], q.shape[1], v.shape[2], device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        ours_f = do_bench(lambda: vk.attention_packed(q, k, v, cu, scale), warmup=10, rep=50)

    def ours_fb():
        vk.attention_packed(q, k, v, cu, scale).backward(do)

    ours_b = do_bench(ours_fb, warmup=5, rep=30, grad_to_none=[q, k, v])
    qs, ks, vs = (_bhld(x, batch, seqlen) for x in (q, k, v))
    dos = _bhld(do, batch, seqlen)

    def ref_fb():
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).backward(dos)

    try:
        with sdpa_kernel(SDPA_BACKENDS):
            with torch.no_grad():
                ref_f = do_bench(
                    lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale), warmup=10, rep=50
                )
            ref_b = do_bench(ref_fb, warmup=5, rep=30, grad_to_none=[qs, ks, vs])
    except RuntimeError as e:  # no fused backend takes K wider than V here: report it, do not time the math path
        print(f"SDPA ({batch} x {seqlen}): {e}".splitlines()[0])
        ref_f = ref_b = float("nan")
    return ours_f, ref_f, ours_b, ref_b


DECODE_BATCHES = [1, 16, 64, 256]
DECODE_CONTEXTS = [1024, 4096, 16384]
PREFILL_SHAPES = [(1, 8192), (4, 2048), (16, 512)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown report")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="moonlight")
    args = ap.parse_args()
    cfg = tiny_deepseek_v3_config(**DEEPSEEK_V3_SHAPES[SHAPES[args.shape]])
    h, dk, dv = cfg.kv_cache_dims
    lines = [
        f"# MLA attention (expanded K/V), {SHAPES[args.shape]} per-layer shape, {torch.cuda.get_device_name()}, "
        f"{datetime.date.today()}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}; {h} heads, K {dk} (= {cfg.qk_nope_head_dim} nope + "
        f"{cfg.qk_rope_head_dim} rope), V {dv}, softmax scale {cfg.softmax_scale:.6g}, bf16, invariant backend.",
        "",
        "## KV cache bytes per token (bf16)",
        "",
        "| layout | per layer | whole model |",
        "|---|---|---|",
    ]
    expanded = h * (dk + dv) * BF16
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16
    n = cfg.num_hidden_layers
    lines += [
        f"| expanded per-head K/V (this release, both drivers) | {expanded} B | {expanded * n / 1024:.0f} KiB |",
        f"| latent c_kv + k_pe (absorbed MLA, future work) | {latent} B | {latent * n / 1024:.1f} KiB |",
        f"| ratio | {expanded / latent:.1f}x | |",
        "",
    ]
    copy_bw = hardware.copy_bandwidth(DEV)
    free = torch.cuda.mem_get_info()[0]
    lines += [
        f"Device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write), the bandwidth of the bounds below.",
        "",
        "## Decode (1 query per sequence, paged, page 16, CUDA graph)",
        "",
        "Bound = K/V bytes read / copy bandwidth; fraction = bound / time. The latent bound is what a latent cache "
        "would need to read for the same step.",
        "",
        "| batch | context | time (us) | expanded bound (us) | fraction of bound | latent bound (us) |",
        "|---|---|---|---|---|---|",
    ]
    for batch, ctx in itertools.product(DECODE_BATCHES, DECODE_CONTEXTS):
        need = batch * ctx * expanded
        if need > 0.6 * free:
            lines.append(f"| {batch} | {ctx} | skipped: {need / 2**30:.0f} GiB of KV | | | |")
            continue
        ms, nbytes = decode_case(cfg, batch, ctx)
        bound = nbytes / copy_bw * 1e6
        lat = batch * ctx * latent / copy_bw * 1e6
        lines.append(f"| {batch} | {ctx} | {ms * 1e3:.1f} | {bound:.1f} | {bound / (ms * 1e3):.2f} | {lat:.1f} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    lines += [
        "",
        "## Prefill / training (causal, packed equal-length sequences) vs torch SDPA on the same expanded K/V",
        "",
        "| batch x seqlen | fwd ours (ms) | fwd SDPA (ms) | fwd TFLOP/s ours / SDPA | fwd+bwd ours (ms) | "
        "fwd+bwd SDPA (ms) | SDPA time / ours, fwd / fwd+bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, seqlen in PREFILL_SHAPES:
        of, rf, ob, rb = prefill_case(cfg, batch, seqlen)
        fl = causal_flops(cfg, batch, seqlen)
        lines.append(
            f"| {batch} x {seqlen} | {of:.2f} | {rf:.2f} | {fl / of / 1e9:.0f} / {fl / rf / 1e9:.0f} | {ob:.2f} | "
            f"{rb:.2f} | {rf / of:.2f} / {rb / ob:.2f} |"
        )
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
