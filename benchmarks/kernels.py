"""Kernel benchmark: invariant kernels vs their torch baselines, measured side by side in one run on the GPU.

    PYTHONPATH=... python benchmarks/kernels.py [--out FILE.md] \
        [--only linear,linear_cold,linear_bwd,rms_norm,decode_norms,logprobs]

Prints markdown tables (throughput and the ratio invariant / baseline) and writes them to --out with the date,
GPU and torch/triton versions.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from functools import partial

import torch
import triton
import triton.testing

import vexact_kernels as vk

M_VALUES = (1, 8, 64, 256, 1024, 4096, 16384)
# (name, N, K): K = N = 4096 and the projection shapes of Qwen3-1.7B (hidden 2048, 16x128 q heads, 8x128 kv heads,
# intermediate 6144) and Qwen3-8B (hidden 4096, 32x128 q heads, 8x128 kv heads, intermediate 12288).
LINEAR_SHAPES = (
    ("square 4096", 4096, 4096),
    ("1.7B q/o", 2048, 2048),
    ("1.7B k/v", 1024, 2048),
    ("1.7B gate/up", 6144, 2048),
    ("1.7B down", 2048, 6144),
    ("8B k/v", 1024, 4096),
    ("8B gate/up", 12288, 4096),
    ("8B down", 4096, 12288),
)


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _ms_graph(fn) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph: kernel time without Python launch overhead, which the engine
    hides the same way (CUDA-graph decode). Both sides of every ratio are timed like this."""
    fn()  # compile / autotune outside the graph
    return triton.testing.do_bench_cudagraph(fn, rep=100)


def bench_linear(lines: list[str]) -> None:
    lines += ["## linear (bf16): invariant Triton matmul vs cuBLAS (`F.linear`)", ""]
    lines += ["| shape | M | N | K | invariant TFLOP/s | cuBLAS TFLOP/s | ratio |", "|---|---|---|---|---|---|---|"]
    small, large = [], []
    for name, n, k in LINEAR_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_inv = _ms_graph(lambda x=x, w=w: vk.linear(x, w))
            t_ref = _ms_graph(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            flops = 2 * m * n * k
            ratio = t_ref / t_inv
            (small if m <= 64 else large if m >= 4096 else []).append(ratio)
            lines.append(
                f"| {name} | {m} | {n} | {k} | {flops / t_inv / 1e9:.1f} | {flops / t_ref / 1e9:.1f} | {ratio:.2f} |"
            )
    gm = lambda r: math.exp(sum(map(math.log, r)) / len(r))  # noqa: E731
    lines += [
        "",
        f"geometric mean ratio, M <= 64: {gm(small):.2f} (goal >= 0.85); M >= 4096: {gm(large):.2f} (goal >= 0.90); "
        f"min M <= 64: {min(small):.2f}, min M >= 4096: {min(large):.2f}",
        "",
    ]


def bench_linear_cold(lines: list[str]) -> None:
    """Decode-sized M with each weight read from HBM, as in a model step (dozens of layers' weights do not fit the
    50 MB L2): copies of the weight, 256 MB in all, are used in turn inside the timed graph, on both sides."""
    lines += ["## linear (bf16), M <= 64, weights streamed from HBM (cold L2)", ""]
    lines += ["| shape | M | N | K | invariant GB/s (weights) | cuBLAS GB/s | ratio |", "|---|---|---|---|---|---|---|"]
    ratios = []
    for name, n, k in LINEAR_SHAPES:
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (1, 8, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def run(f, x=x, ws=ws):
                for w in ws:
                    f(x, w)

            t_inv = _ms_graph(lambda run=run: run(vk.linear))
            t_ref = _ms_graph(lambda run=run: run(torch.nn.functional.linear))
            gbytes = copies * n * k * 2 / 1e9
            ratios.append(t_ref / t_inv)
            lines.append(
                f"| {name} | {m} | {n} | {k} | {gbytes / t_inv * 1e3:.0f} | {gbytes / t_ref * 1e3:.0f} | "
                f"{t_ref / t_inv:.2f} |"
            )
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    lines += ["", f"geometric mean ratio, M <= 64 cold: {gm:.2f} (goal >= 0.85); min {min(ratios):.2f}", ""]


BWD_TOKENS = (4096, 16384)


def bench_linear_bwd(lines: list[str]) -> None:
    """The trainer's linear backward, as ``LinearFunction.backward`` runs it: ``dX = dY @ W`` and ``dW = dY.T @ X``
    (column-major operands), invariant (column-major operands through TMA, and through the pointer kernel as before)
    against cuBLAS on the same views; CUDA-graph replays, so the kernels' time without the host's launch cost."""
    from vexact_kernels.triton_ops import matmul as mm

    lines += ["## linear backward (bf16, dX = dY @ W and dW = dY.T @ X): invariant vs cuBLAS", ""]
    lines += [
        "| shape | tokens | N | K | invariant TFLOP/s | pointer kernel (before) TFLOP/s | cuBLAS TFLOP/s | ratio | "
        "ratio before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for name, n, k in LINEAR_SHAPES[1:]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in BWD_TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

            def ours(x=x, w=w, gy=gy):
                mm.matmul(gy, w.t())
                mm.matmul(gy.t(), x.t(), out_dtype=w.dtype)

            def cublas(x=x, w=w, gy=gy):
                gy @ w
                gy.t() @ x

            t_inv = _ms_graph(ours)
            mm.TMA_COLUMN_MAJOR = False
            try:
                t_old = _ms_graph(ours)
            finally:
                mm.TMA_COLUMN_MAJOR = True
            t_ref = _ms_graph(cublas)
            flops = 4 * m * n * k
            ratios.append(t_ref / t_inv)
            lines.append(
                f"| {name} | {m} | {n} | {k} | {flops / t_inv / 1e9:.1f} | {flops / t_old / 1e9:.1f} | "
                f"{flops / t_ref / 1e9:.1f} | {t_ref / t_inv:.2f} | {t_ref / t_old:.2f} |"
            )
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    lines += ["", f"geometric mean ratio (invariant / cuBLAS): {gm:.2f}; min {min(ratios):.2f}", ""]


RMS_M = (1, 64, 1024, 4096, 16384)
RMS_H = (2048, 4096)
LOGPROBS_T = (1, 64, 1024, 4096, 16384)
LOGPROBS_H = (2048, 4096)  # Qwen3-1.7B, Qwen3-8B
VOCAB = 151936  # Qwen3
EPS = 1e-6


def _torch_rms_norm(x, w, eps=EPS):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _fwd_bwd(fn, *inputs):
    """A callable running ``fn`` forward and backward (a fixed upstream gradient) on fresh leaves."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def run():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    return run


def bench_rms_norm(lines: list[str]) -> None:
    """rms_norm (bf16 in and out): the Triton kernel vs torch eager (HF's RMSNorm), forward and forward+backward."""
    lines += ["## rms_norm (bf16): invariant Triton vs torch eager (HF RMSNorm)", ""]
    lines += ["| pass | M | H | invariant ms | torch ms | ratio torch/invariant |", "|---|---|---|---|---|---|"]
    for h in RMS_H:
        w = 1.0 + 0.1 * torch.randn(h, device="cuda", dtype=torch.bfloat16)
        for m in RMS_M:
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
            for name, inv, ref in (
                ("fwd", lambda x=x, w=w: vk.rms_norm(x, w, EPS), lambda x=x, w=w: _torch_rms_norm(x, w)),
                (
                    "fwd+bwd",
                    _fwd_bwd(lambda a, b: vk.rms_norm(a, b, EPS), x, w),
                    _fwd_bwd(_torch_rms_norm, x, w),
                ),
            ):
                t_inv, t_ref = _ms(inv), _ms(ref)
                lines.append(f"| {name} | {m} | {h} | {t_inv:.4f} | {t_ref:.4f} | {t_ref / t_inv:.2f} |")
    lines.append("")


# Decode-sized launches of a decoder layer's norms: (layout, hidden, q heads, kv heads, head_dim) of the Qwen3-1.7B,
# Qwen3-8B and Qwen3-30B-A3B attention, at the batch sizes of an RL rollout's decode steps.
DECODE_NORM_LAYOUTS = (("1.7b", 2048, 16, 8, 128), ("8b", 4096, 32, 8, 128), ("30b-a3b", 2048, 32, 4, 128))
DECODE_NORM_ROWS = (64, 128, 160, 256, 512)
DECODE_NORM_PAGE = 16


def bench_decode_norms(lines: list[str]) -> None:
    """The norm launches of a decode step, each as one CUDA graph replay (inputs warm in L2, as after the matmul that
    wrote them): the residual add + RMSNorm (``add_rms_norm``, twice a layer) and the q/k norms + rotary + paged KV
    write (``rms_norm_rotary_qk`` with ``kv_write``, once a layer), against the copy bound (the bytes each must read
    and write at the measured device-to-device copy bandwidth) and, for the add + norm, torch eager (an add and HF's
    RMSNorm). A decoder layer's norm time is 2 x the first + the second."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from hardware import copy_bandwidth

    bw = copy_bandwidth("cuda")
    lines += [f"## Decode-step norms (bf16), one CUDA graph replay per launch; copy bandwidth {bw / 1e12:.2f} TB/s", ""]
    lines += [
        "| layout | rows | add + norm µs | copy bound µs | torch eager µs | q/k norm + rotary + KV write µs "
        "| copy bound µs | layer's norms µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, h, hq, hk, d in DECODE_NORM_LAYOUTS:
        w = 1.0 + 0.1 * torch.randn(h, device="cuda", dtype=torch.bfloat16)
        wq, wk = (1.0 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cos, sin = vk.rope_cos_sin(d, 8192, 1e6)
        cos, sin = cos.cuda(), sin.cuda()
        for m in DECODE_NORM_ROWS:
            x, r = (torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            t_add = _ms_graph(partial(vk.add_rms_norm, x, r, w, EPS)) * 1e3
            t_torch = _ms_graph(lambda x=x, r=r, w=w: _torch_rms_norm(x + r, w)) * 1e3
            qkv = torch.randn(m, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(m, hq, d), k.view(m, hk, d), v.view(m, hk, d)
            pages = -(-m // DECODE_NORM_PAGE) + 1
            kc, vc = (torch.zeros(pages, DECODE_NORM_PAGE, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            slots = torch.randperm(pages * DECODE_NORM_PAGE, device="cuda")[:m]
            pos = torch.randint(0, 8192, (m,), device="cuda")
            write = (v, kc, vc, slots)
            t_qk = _ms_graph(partial(vk.rms_norm_rotary_qk, q, wq, k, wk, EPS, pos, cos, sin, kv_write=write)) * 1e3
            add_bytes = 4 * m * h * 2 + h * 2
            qk_bytes = m * d * 2 * ((hq + 2 * hk) + (hq + hk) + 2 * hk)
            lines.append(
                f"| {name} | {m} | {t_add:.2f} | {add_bytes / bw * 1e6:.2f} | {t_torch:.2f} | {t_qk:.2f} | "
                f"{qk_bytes / bw * 1e6:.2f} | {2 * t_add + t_qk:.1f} |"
            )
    lines.append("")


def _torch_logprobs(hidden, norm_w, head, targets, temps):
    """The materialised baseline: bf16 logits -> fp32 [T, V] -> log_softmax -> gather, plus entropy."""
    logits = torch.nn.functional.linear(_torch_rms_norm(hidden, norm_w), head).float() / temps[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _peak_mib(fn) -> str:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        fn()
    except torch.OutOfMemoryError:
        return "OOM"
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}"


def bench_logprobs(lines: list[str]) -> None:
    """Logprob + entropy of targets from pre-norm hidden states, V = 151936: the fused Triton kernel (never holds
    [T, V] logits) vs torch materialising fp32 logits; time and peak extra memory (MiB above the inputs)."""
    lines += [f"## logprobs + entropy from hidden states (bf16, V = {VOCAB}): fused Triton vs torch materialised", ""]
    lines += [
        "| pass | T | H | invariant ms | torch ms | ratio torch/invariant | invariant peak MiB | torch peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in LOGPROBS_H:
        head = (torch.randn(VOCAB, h, device="cuda") / h**0.5).to(torch.bfloat16)
        norm_w = 1.0 + 0.1 * torch.randn(h, device="cuda", dtype=torch.bfloat16)
        for t in LOGPROBS_T:
            hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            targets = torch.randint(0, VOCAB, (t,), device="cuda")
            temps = torch.full((t,), 0.9, device="cuda")

            def inv(hidden=hidden, head=head, norm_w=norm_w, targets=targets, temps=temps):
                return vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, temps, with_entropy=True)

            def ref(hidden=hidden, head=head, norm_w=norm_w, targets=targets, temps=temps):
                return _torch_logprobs(hidden, norm_w, head, targets, temps)

            def inv_loss(a, b, targets=targets, temps=temps, norm_w=norm_w):
                lp, ent = vk.logprobs_from_hidden(a, norm_w, EPS, b, targets, temps, with_entropy=True)
                return lp.sum() + ent.sum()

            def ref_loss(a, b, targets=targets, temps=temps, norm_w=norm_w):
                lp, ent = _torch_logprobs(a, norm_w, b, targets, temps)
                return lp.sum() + ent.sum()

            passes = [("fwd", inv, ref)]
            if t >= 1024:  # training shapes
                passes.append(("fwd+bwd", _fwd_bwd(inv_loss, hidden, head), _fwd_bwd(ref_loss, hidden, head)))
            for name, f_inv, f_ref in passes:
                m_inv, m_ref = _peak_mib(f_inv), _peak_mib(f_ref)
                t_inv = _ms(f_inv)
                t_ref = _ms(f_ref) if m_ref != "OOM" else float("nan")
                lines.append(
                    f"| {name} | {t} | {h} | {t_inv:.3f} | {t_ref:.3f} | {t_ref / t_inv:.2f} | {m_inv} | {m_ref} |"
                )
            del hidden, targets, temps
        del head
        torch.cuda.empty_cache()
    lines.append("")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    wanted = set(filter(None, args.only.split(",")))
    lines = [
        f"# Kernel benchmark ({datetime.date.today().isoformat()})",
        "",
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
        "linear timed by triton.testing.do_bench_cudagraph (median ms, CUDA-graph replay: no launch overhead), "
        "rms_norm/logprobs by triton.testing.do_bench; invariant and baseline measured side by side in one run.",
        "",
    ]
    sections = {"linear": bench_linear, "linear_cold": bench_linear_cold, "linear_bwd": bench_linear_bwd}
    for name in ("rms_norm", "decode_norms", "logprobs"):
        fn = globals().get(f"bench_{name}")
        if fn is not None:
            sections[name] = fn
    print("\n".join(lines), flush=True)
    for name, fn in sections.items():
        if not wanted or name in wanted:
            start = len(lines)
            fn(lines)
            print("\n".join(lines[start:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
