"""Registers, spills and shared memory of the Triton kernels, compiled for a GPU on a machine without one.

    python scripts/tuning/kernel_regs.py [--arch 90] [--only logprobs,linear,attention,norm,other] \
        [--match 'draw T=256']

Triton compiles for a target without its driver: this script makes a stand-in driver that reports ``sm_<arch>``,
turns every kernel launch into a compile (``JITFunction.run`` with ``warmup=True``: the real argument binding and
specialisation, nothing runs), calls the kernels' host functions on CPU tensors of the Qwen3-1.7B shapes (the decode,
prefill and training paths the engine and the trainer take; TMA where the arch has it), and prints, per compiled
kernel, ptxas's registers per thread, the stack (spilled registers, in bytes per thread) and the static + dynamic
shared memory, read from the cubin with ``cuobjdump -res-usage`` (Triton's own ptxas tools). A kernel that spills
(stack > 0) in a hot loop is slow in a way no timing on one shape explains: the fused draw's 1472 bytes of spills
(the Gumbel noise inside the logits tiles) were found this way.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # compile here, whatever Triton's cache holds

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H, V, INTER, HQ, HKV, D, PAGE = 2048, 151936, 6144, 16, 8, 128, 16  # Qwen3-1.7B
SM_COUNT = 132  # H100 SXM: the persistent TMA kernels' grid (speed only)


class StandInDriver:
    """The active-driver interface ``JITFunction`` asks for a target, a device and a stream."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return ty


COMPILED: list[tuple[str, str, object]] = []  # (scenario, kernel name, CompiledKernel) of every launch
_scenario = [""]


def _compile_only(run):
    def patched(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel is not None and not any(s == _scenario[0] and k is kernel for s, _, k in COMPILED):
            COMPILED.append((_scenario[0], self.fn.__name__, kernel))
        return kernel

    return patched


_USAGE: dict[int, tuple[int, int, int]] = {}


def usage(kernel) -> tuple[int, int, int]:
    """(registers, stack bytes, shared bytes) of a compiled kernel."""
    if id(kernel) in _USAGE:
        return _USAGE[id(kernel)]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", out))
    shared = int(fields.get("SHARED", 0)) + kernel.metadata.shared
    _USAGE[id(kernel)] = (int(fields.get("REG", -1)), int(fields.get("STACK", -1)), shared)
    return _USAGE[id(kernel)]


def scenarios(arch: int):
    """(group, name, callable): the host calls whose launches are compiled."""
    from vexact_kernels.triton_ops import activation as ac
    from vexact_kernels.triton_ops import attention as at
    from vexact_kernels.triton_ops import attention_bwd as atb
    from vexact_kernels.triton_ops import logprobs as lp
    from vexact_kernels.triton_ops import matmul as mm
    from vexact_kernels.triton_ops import moe as mo
    from vexact_kernels.triton_ops import rms_norm as rn
    from vexact_kernels.triton_ops import rotary as ro
    from vexact_kernels.triton_ops.sample import triton_gumbel_argmax

    bf = dict(dtype=torch.bfloat16)
    head = torch.empty(V, H, **bf)

    def logprobs(t, sample):
        normed, temps = torch.empty(t, H, **bf), torch.ones(t)
        ints = torch.zeros(t, dtype=torch.int64)
        return lambda: lp._fwd(normed, head, None if sample else ints, temps, ints if sample else None)

    def logprobs_bwd(t):
        normed, temps, tgt = torch.empty(t, H, **bf), torch.ones(t), torch.zeros(t, dtype=torch.int64)
        stat = torch.zeros(t)
        return lambda: lp.logprobs_bwd(normed, head, tgt, temps, stat, stat, stat, stat, None, True, True)

    def linear(m, n, k):
        a, w = torch.empty(m, k, **bf), torch.empty(n, k, **bf)
        return lambda: mm.matmul(a, w)

    def paged(batch, ctx, q_per_seq, window=None, sinks=None):
        pages = -(-ctx // PAGE)
        q = torch.empty(batch * q_per_seq, HQ, D, **bf)
        kc = torch.empty(batch * pages, PAGE, HKV, D, **bf)
        tables = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        cu = torch.arange(0, batch * q_per_seq + 1, q_per_seq, dtype=torch.int32)
        return lambda: at.attention_paged(q, kc, kc, tables, lens, cu, window=window, sinks=sinks)

    def packed(seqs, length, window=None, sinks=None):
        q = torch.empty(seqs * length, HQ, D, **bf)
        k = torch.empty(seqs * length, HKV, D, **bf)
        cu = torch.arange(0, seqs * length + 1, length, dtype=torch.int32)
        return lambda: atb.attention_packed(q, k, k, cu, window=window, sinks=sinks)

    def packed_bwd(seqs, length, hq=HQ, hkv=HKV, dk=D, dv=D, window=None):
        t = seqs * length
        q, k = torch.empty(t, hq, dk, **bf), torch.empty(t, hkv, dk, **bf)
        v, o = torch.empty(t, hkv, dv, **bf), torch.empty(t, hq, dv, **bf)
        cu = torch.arange(0, t + 1, length, dtype=torch.int32)
        layout = atb.packed_layout(cu, torch.device("cpu"), hq // hkv, t)
        return lambda: atb._bwd(q, k, v, o, torch.zeros(t, hq), o, layout, dk**-0.5, window)

    def norm(t):
        x, w = torch.empty(t, H, **bf), torch.ones(H, **bf)
        return lambda: rn.rms_norm_fwd(x, w, 1e-6, torch.bfloat16)

    def qk_norm(t):  # q and k as the dense model gives them: views into the grouped q/k/v matmul's output
        qkv, w = torch.empty(t, (HQ + 2 * HKV) * D, **bf), torch.ones(D, **bf)
        q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        return lambda: rn.triton_rms_norm_pair(q.view(t, HQ, D), w, k.view(t, HKV, D), w, 1e-6)

    def add_norm(t):
        x, w = torch.empty(t, H, **bf), torch.ones(H, **bf)
        return lambda: rn.add_rms_norm_fwd(x, x, w, 1e-6)

    def norm_bwd(t):
        x, w = torch.empty(t, H, **bf), torch.ones(H, **bf)
        return lambda: rn.rms_norm_bwd(x, x, w, torch.ones(t))

    def moe(t, experts=128, k=8, inter=768):  # Qwen3-30B-A3B's expert shapes at H = 2048
        x = torch.empty(t, H, **bf)
        w13, w2 = torch.empty(experts, 2 * inter, H, **bf), torch.empty(experts, H, inter, **bf)
        ids = (torch.arange(t * k) % experts).view(t, k)
        return lambda: mo.triton_fused_moe(x, w13, w2, torch.ones(t, k), ids)

    def moe_wgrad(t, experts=128, k=8, inter=768):  # the backward's expert weight and bias gradients
        plan = mo._Plan((torch.arange(t * k) % experts).view(t, k), experts)
        x, dy = torch.empty(t, H, **bf), torch.empty(t * k, H, **bf)
        dh, act = torch.empty(t * k, 2 * inter, **bf), torch.empty(t * k, inter, **bf)
        return lambda: (
            mo._grouped_wgrad(dy, act, None, plan, torch.bfloat16),
            mo._grouped_wgrad(dh, x, plan.tok, plan, torch.bfloat16),
            mo._bias_grad(dy, plan, torch.bfloat16),
        )

    def rotary(t):
        q, k = torch.empty(t, HQ, D, **bf), torch.empty(t, HKV, D, **bf)
        cos = torch.ones(4096, D // 2)
        return lambda: ro.triton_apply_rotary_pair(q, k, torch.zeros(t, dtype=torch.int64), cos, cos)

    def silu(t):
        g = torch.empty(t, INTER, **bf)
        return lambda: ac.silu_and_mul_fwd(g, g)

    def write_kv(t):
        k, cache = torch.empty(t, HKV, D, **bf), torch.empty(64, PAGE, HKV, D, **bf)
        return lambda: at.write_kv_cache(k, k, cache, cache, torch.zeros(t, dtype=torch.int64))

    def logits_ops(t):
        logits, temps, seeds = torch.empty(t, V), torch.ones(t), torch.zeros(t, dtype=torch.int64)
        return lambda: (lp.triton_log_softmax(logits, temps), triton_gumbel_argmax(logits, temps, seeds))

    yield "logprobs", "score T=256", logprobs(256, False)
    yield "logprobs", "draw T=1", logprobs(1, True)
    yield "logprobs", "draw T=16", logprobs(16, True)
    yield "logprobs", "draw T=256", logprobs(256, True)
    yield "logprobs", "backward T=4096", logprobs_bwd(4096)
    for m in (1, 256, 4096):
        yield "linear", f"qkv M={m}", linear(m, (HQ + 2 * HKV) * D, H)
        yield "linear", f"gate_up M={m}", linear(m, 2 * INTER, H)
        yield "linear", f"down M={m}", linear(m, H, INTER)
    yield (
        "linear",
        "down M=256, TMA split programs 64x64",
        lambda: mm.matmul(
            torch.empty(256, INTER, **bf),
            torch.empty(H, INTER, **bf),
            config=(64, 64, 4, 4, False),
            split_programs=True,
        ),
    )
    yield "attention", "decode batch 1 ctx 4096", paged(1, 4096, 1)
    yield "attention", "decode batch 256 ctx 512", paged(256, 512, 1)
    yield "attention", "prefill chunk 1024", paged(1, 1024, 1024)
    yield "attention", "packed 8 x 512", packed(8, 512)
    yield "attention", "packed 8 x 512, backward", packed_bwd(8, 512)
    # gpt-oss's sliding-window layers: a window of 128 keys and a sink logit per head
    sinks = torch.zeros(HQ, **bf)
    yield "attention", "decode batch 1 ctx 4096, window + sinks", paged(1, 4096, 1, 128, sinks)
    yield "attention", "decode batch 256 ctx 512, window + sinks", paged(256, 512, 1, 128, sinks)
    yield "attention", "prefill chunk 1024, window + sinks", paged(1, 1024, 1024, 128, sinks)
    yield "attention", "packed 8 x 512, window + sinks", packed(8, 512, 128, sinks)
    yield "attention", "packed 8 x 512, window, backward", packed_bwd(8, 512, window=128)
    # Moonlight / DeepSeek-V3 MLA in its expanded form: 16 heads, q/k head dim 192, v head dim 128
    yield "attention", "MLA packed 8 x 512, backward", packed_bwd(8, 512, hq=16, hkv=16, dk=192, dv=128)
    yield "norm", "rms_norm T=256", norm(256)
    yield "norm", "q/k rms_norm pair T=256", qk_norm(256)
    yield "norm", "add_rms_norm T=256", add_norm(256)
    yield "norm", "rms_norm backward T=4096", norm_bwd(4096)
    yield "other", "fused MoE T=256 (128 experts, k = 8)", moe(256)
    yield "other", "fused MoE backward, weight gradients T=256", moe_wgrad(256)
    yield "other", "rotary q/k T=256", rotary(256)
    yield "other", "silu_and_mul T=256", silu(256)
    yield "other", "write_kv T=256", write_kv(256)
    yield "other", "log_softmax + gumbel argmax T=16 (fast backend's draw)", logits_ops(16)


def install_stand_in(arch: int, fused_combine: bool = False) -> None:
    """Make every kernel launch a compile for ``sm_<arch>`` (recorded in ``COMPILED``), and answer the host's
    GPU-only checks for the stand-in device (alignment still checked). ``fused_combine``: the split launches of the
    matmul and the attention fold their splits in the launch (their tile counts on CPU), as on a GPU by default;
    else they take the two-launch path (a combine kernel)."""
    from vexact_kernels.triton_ops import logprobs as lp
    from vexact_kernels.triton_ops import matmul as mm

    driver.set_active(StandInDriver(arch))
    JITFunction.run = _compile_only(JITFunction.run)

    def aligned(t):
        return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0

    mm._tma_ok = lambda a, b_t: arch >= 90 and aligned(a) and aligned(b_t)
    from vexact_kernels.triton_ops import moe as mo

    mo._plan_kernels_ok = lambda device, pairs: 0 < pairs <= mo.PLAN_KERNEL_MAX_PAIRS
    lp._cuda_major = lambda device: arch // 10
    mm._num_sms = lambda device: SM_COUNT
    if not hasattr(mm, "_gpu_tile_counters"):
        mm._gpu_tile_counters = mm._tile_counters
    mm._tile_counters = mm._gpu_tile_counters if fused_combine else (lambda device, tiles: None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10: 80 (A100), 90 (H100/H200), 100")
    ap.add_argument("--only", default="", help="comma-separated groups: logprobs, linear, attention, norm, other")
    ap.add_argument("--match", default="", help="only the calls whose name contains this, e.g. 'draw T=256'")
    args = ap.parse_args()
    install_stand_in(args.arch)
    groups = {g for g in args.only.split(",") if g}
    print(f"Triton {triton.__version__}, target sm_{args.arch}; registers per thread, stack (spills) and shared "
          f"memory in bytes per kernel as compiled for each call")  # fmt: skip
    print("\n| call | kernel | warps | stages | registers | stack bytes | shared bytes |")
    print("|---|---|---|---|---|---|---|")
    for group, name, call in scenarios(args.arch):
        if (groups and group not in groups) or args.match not in name:
            continue
        _scenario[0] = f"{group}: {name}"
        try:
            call()
        except Exception as e:  # a host path this stand-in cannot take: say so, go on
            print(f"| {group}: {name} | (not compiled: {type(e).__name__}: {str(e).splitlines()[0][:100]}) |||||")
            continue
        for scen, kname, kernel in [c for c in COMPILED if c[0] == _scenario[0]]:
            regs, stack, shared = usage(kernel)
            meta = kernel.metadata
            flag = " **spills**" if stack > 0 else ""
            print(f"| {scen} | {kname} | {meta.num_warps} | {meta.num_stages} | {regs} | {stack}{flag} | {shared} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
