"""Invariant attention on the GPU, measured side by side in one run (prints markdown tables).

- decode: one new token per sequence over a paged KV cache (page 16, pages shuffled); achieved HBM bandwidth (K/V
  bytes read + q/o) as a fraction of a device-to-device copy's bandwidth measured in the same run;
- prefill / training forward: TFLOP/s of the packed causal kernel vs ``scaled_dot_product_attention`` (flash backend)
  on the same shapes (equal-length sequences, so SDPA sees a dense [B, H, L, D] batch);
- backward: TFLOP/s of the deterministic backward vs SDPA's backward (flash).

Usage: ``PYTHONPATH=<packages' src dirs>:. python benchmarks/attention.py [--sweep]``. ``--sweep`` also times a few
alternative tile configurations (for choosing the fixed constants; a change of the forward's constants changes the
numerics of every GPU target).
"""

from __future__ import annotations

import argparse
import datetime
import itertools

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from vexact_kernels.triton_ops import attention as ta

HQ, HKV, D = 32, 8, 128  # Qwen3-8B-shaped attention
PAGE = 16
DEV = "cuda"


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * (1 << 31) / (ms * 1e-3)


def decode_case(batch: int, ctx: int, d: int = D):
    pages_per_seq = ctx // PAGE
    num_pages = batch * pages_per_seq
    kc = torch.randn(num_pages, PAGE, HKV, d, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, pages_per_seq)
    q = torch.randn(batch, HQ, d, device=DEV, dtype=torch.bfloat16)
    ctx_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    fn = lambda: ta.attention_paged(q, kc, vc, bt, ctx_lens, cu)  # noqa: E731
    fn()
    ms = do_bench_cudagraph(fn, rep=50)  # as the engine runs decode: in a CUDA graph (no host sync in the op)
    eager = do_bench(fn, warmup=10, rep=50)
    nbytes = 2 * kc.numel() * kc.element_size() + 2 * q.numel() * q.element_size()
    return ms, nbytes / (ms * 1e-3), eager


def _dense(batch, seqlen, d=D, grad=False):
    q = torch.randn(batch * seqlen, HQ, d, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(batch * seqlen, HKV, d, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(batch * seqlen, HKV, d, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    cu = torch.arange(0, batch * seqlen + 1, seqlen, device=DEV, dtype=torch.int32)
    return q, k, v, cu


def _sdpa_inputs(q, k, v, batch, seqlen):
    """[B, H, L, D] views for SDPA; K/V heads repeated for GQA (outside the timed region)."""
    g = HQ // HKV

    def bhld(t):
        return t.detach().view(batch, seqlen, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()

    qs = bhld(q).requires_grad_()
    ks = bhld(k).repeat_interleave(g, 1).contiguous().requires_grad_()
    vs = bhld(v).repeat_interleave(g, 1).contiguous().requires_grad_()
    return qs, ks, vs


def causal_flops(batch, seqlen, d=D):
    return 4 * batch * seqlen * seqlen / 2 * HQ * d  # two matmuls, half the square


def prefill_case(batch, seqlen):
    q, k, v, cu = _dense(batch, seqlen)
    scale = D**-0.5
    ours = do_bench(lambda: ta._packed_fwd(q, k, v, cu, scale, False), warmup=10, rep=50)
    qs, ks, vs = _sdpa_inputs(q, k, v, batch, seqlen)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
        ref = do_bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), warmup=10, rep=50)
    return causal_flops(batch, seqlen) / (ours * 1e-3) / 1e12, causal_flops(batch, seqlen) / (ref * 1e-3) / 1e12


def backward_case(batch, seqlen):
    q, k, v, cu = _dense(batch, seqlen)
    scale = D**-0.5
    o, lse = ta._packed_fwd(q, k, v, cu, scale, True)
    do = torch.randn_like(o)
    ours = do_bench(lambda: ta._bwd(q, k, v, o, lse, do, cu, scale), warmup=10, rep=50)
    qs, ks, vs = _sdpa_inputs(q, k, v, batch, seqlen)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        dos = torch.randn_like(out)
        ref = do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), dos, retain_graph=True), warmup=10, rep=50)
    fl = 2.5 * causal_flops(batch, seqlen)
    return fl / (ours * 1e-3) / 1e12, fl / (ref * 1e-3) / 1e12


PREFILL_SHAPES = [(1, 16384), (4, 4096), (8, 2048), (16, 1024), (32, 512)]


FWD_SWEEP = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3), (64, 32, 4, 3)]
BWD_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]


def _set(names, cfg):
    old = tuple(getattr(ta, n) for n in names)
    for n, x in zip(names, cfg, strict=True):
        setattr(ta, n, x)
    return old


def sweep(fwd_configs=FWD_SWEEP, bwd_configs=BWD_SWEEP):
    """Time alternative constants. Prefer one forward config per process (``--fwd-config``): switching configs in
    one process after CUDA-graph captures once ended in an illegal memory access (H100, Triton 3.6) that the same
    configs never showed in fresh processes or in the tests."""
    fwd = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
    print("\n### Sweep: forward tile configs (prefill TFLOP/s; decode TB/s, CUDA graph)\n")
    print("| BLOCK_M | BLOCK_N | warps | stages | prefill 4x4096 | prefill 32x512 | decode 64x4096 | decode 256x4096 |")
    print("|---|---|---|---|---|---|---|---|")
    for cfg in fwd_configs:
        keep = _set(fwd, cfg)
        try:
            p1, _ = prefill_case(4, 4096)
            p2, _ = prefill_case(32, 512)
            _, b1, _ = decode_case(64, 4096)
            _, b2, _ = decode_case(256, 4096)
            row = f"{p1:.0f} | {p2:.0f} | {b1 / 1e12:.2f} | {b2 / 1e12:.2f}"
        except Exception as e:  # an out-of-resources config is a result, not a crash
            row = f"failed: {type(e).__name__} | | |"
        _set(fwd, keep)
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {row} |")
    bwd = ("BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_NUM_WARPS", "BWD_NUM_STAGES")
    print("\n### Sweep: backward configs (TFLOP/s)\n")
    print("| BLOCK_M | BLOCK_N | warps | stages | 4x4096 | 32x512 |")
    print("|---|---|---|---|---|---|")
    for cfg in bwd_configs:
        keep = _set(bwd, cfg)
        try:
            b1, _ = backward_case(4, 4096)
            b2, _ = backward_case(32, 512)
            row = f"{b1:.0f} | {b2:.0f}"
        except Exception as e:
            row = f"failed: {type(e).__name__} |"
        _set(bwd, keep)
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {row} |")


def cross_config_check():
    """Informative only: are forward outputs bitwise equal across (BLOCK_M, num_warps) with BLOCK_N fixed?"""
    fwd = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
    print("\n### Cross-config bitwise check (same BLOCK_N=64; not relied upon)\n")
    for d in (64, 128):
        torch.manual_seed(d)
        lens = [1, 63, 64, 65, 700, 4096, 2000]
        t = sum(lens)
        q = torch.randn(t, HQ, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(t, HKV, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(t, HKV, d, device=DEV, dtype=torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
        outs = {}
        for cfg in [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 4, 3), (64, 64, 8, 3)]:
            keep = _set(fwd, cfg)
            outs[cfg] = ta._packed_fwd(q, k, v, cu, d**-0.5, False)[0]
            _set(fwd, keep)
        base = outs[(128, 64, 8, 3)]
        for cfg, o in outs.items():
            print(f"- D={d} {cfg} vs (128, 64, 8, 3): equal={torch.equal(o, base)} max diff {(o - base).abs().max()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cross-config", action="store_true")
    ap.add_argument("--fwd-config", help="sweep only this forward config, e.g. 64,64,4,3 (one per process)")
    args = ap.parse_args()
    free = torch.cuda.mem_get_info()[0]
    print(f"# Invariant attention, {torch.cuda.get_device_name()}, {datetime.date.today()}")
    print(f"torch {torch.__version__}, triton {triton.__version__}; Hq={HQ}, Hkv={HKV}, D={D}, bf16")
    print(
        f"forward tiles: BLOCK_M={ta.BLOCK_M} BLOCK_N={ta.BLOCK_N} warps={ta.NUM_WARPS} stages={ta.NUM_STAGES}; "
        f"backward: {ta.BWD_BLOCK_M}x{ta.BWD_BLOCK_N} warps={ta.BWD_NUM_WARPS} stages={ta.BWD_NUM_STAGES}"
    )
    if args.sweep or args.cross_config:  # exploration runs: only what was asked for
        if args.sweep and args.fwd_config:
            sweep([tuple(int(x) for x in args.fwd_config.split(","))], [])
        elif args.sweep:
            sweep()
        if args.cross_config:
            cross_config_check()
        return
    copy_bw = copy_bandwidth()
    print(f"\ndevice-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    print("## Decode (1 query token per sequence, paged KV, page 16)\n")
    print("| batch | context | time (us), CUDA graph | achieved TB/s | fraction of copy | eager time (us) |")
    print("|---|---|---|---|---|---|")
    for batch, ctx in itertools.product([1, 16, 64, 256], [512, 4096, 16384]):
        need = 2 * batch * ctx * HKV * D * 2
        if need > 0.6 * free:
            print(f"| {batch} | {ctx} | skipped: {need / 2**30:.0f} GiB of KV | | | |")
            continue
        ms, bw, eager = decode_case(batch, ctx)
        print(f"| {batch} | {ctx} | {ms * 1e3:.1f} | {bw / 1e12:.2f} | {bw / copy_bw:.2f} | {eager * 1e3:.1f} |")
        torch.cuda.empty_cache()
    print("\n## Prefill / training forward (causal, packed equal-length sequences)\n")
    print("| batch x seqlen | ours TFLOP/s | SDPA flash TFLOP/s | ratio |")
    print("|---|---|---|---|")
    for batch, seqlen in PREFILL_SHAPES:
        ours, ref = prefill_case(batch, seqlen)
        print(f"| {batch} x {seqlen} | {ours:.0f} | {ref:.0f} | {ours / ref:.2f} |")
    print("\n## Backward (dQ, dK, dV; 2.5x forward FLOPs)\n")
    print("| batch x seqlen | ours TFLOP/s | SDPA flash TFLOP/s | ratio |")
    print("|---|---|---|---|")
    for batch, seqlen in PREFILL_SHAPES:
        ours, ref = backward_case(batch, seqlen)
        print(f"| {batch} x {seqlen} | {ours:.0f} | {ref:.0f} | {ours / ref:.2f} |")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
