"""Probe FlashAttention 4 (flash-attn-4, CuTe DSL) on the GPU machine: does it give VeXact's invariances?
(Written against flash-attn-4 4.0.0b36; checked on CPU against a stand-in only, not yet run on a GPU.)

    bash scripts/staging/fa4_device_wheels.sh stage && bash scripts/staging/fa4_device_wheels.sh install  # see there
    source scripts/staging/device_env.sh && python3 scripts/checks/fa4_probe.py 2>&1 | tee $OUT/fa4-probe.txt

GQA 32/8, head_dim 128, bf16, causal, ``num_splits=1``. Prints, each check on its own line (``OK``/``DIFF``/``ERROR``):
the exact signature and versions used; a sequence alone == its rows of a packed varlen batch; paged decode of each
sequence's last token (``page_table``, several page sizes, pages shuffled) == that packed row; a chunked prefill
(second part of each sequence against its whole prefix, through the paged cache) == packed; a mixed step (decode
rows and chunks in one call) == packed; the same under a CUDA graph; ``pack_gqa`` True vs False; the perturbations a
test could use (``num_splits=2``, another KV tile through ``_flash_attn_fwd(tile_mn=...)``); backward with
``deterministic=True`` run to run, and against ``deterministic=False``. Every check runs even if an earlier one fails.
Then the core checks again at the tiny checkpoints' shape (GQA 4/2, head_dim 16), which the contracts run.

Knobs (defaults in brackets): FA4_PROBE_PAGES [16,64,128,256], FA4_PROBE_LENS [1000,37,513,2048,129,700,1,255],
FA4_PROBE_DEVICE [cuda; ``cpu`` smoke-tests this script against a stand-in module put first on PYTHONPATH].
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
import time
import traceback

import torch

HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
LENS = [int(n) for n in os.environ.get("FA4_PROBE_LENS", "1000,37,513,2048,129,700,1,255").split(",")]
PAGES = [int(p) for p in os.environ.get("FA4_PROBE_PAGES", "16,64,128,256").split(",")]
RESULTS: list[tuple[str, str]] = []


def check(name):
    def deco(fn):
        t0 = time.time()
        try:
            res = fn()
            status = "OK" if res is True else ("DIFF" if res is False else f"INFO {res}")
        except Exception as e:  # a probe: report and go on
            status = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            traceback.print_exc(limit=4)
        print(f"[{status.split()[0]}] {name}: {status} ({time.time() - t0:.1f}s)", flush=True)
        RESULTS.append((name, status))
        return fn

    return deco


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def cu_of(lens, dev):
    """int32 cumulative offsets [0, l0, l0+l1, ...]."""
    return torch.tensor(list(itertools.accumulate(lens, initial=0)), dtype=torch.int32, device=dev)


def eq(a, b, what=""):
    same = torch.equal(a, b)
    if not same:
        d = (a.float() - b.float()).abs()
        rows = int((d.amax(dim=(-1, -2)) > 0).sum())
        print(f"    {what} differ: max |d| {d.max().item():.3e}, rows differing {rows}")
    return same


def probe(fi, fav, dev, hq, hkv, d, pages, full, tag):
    """The checks at one attention shape; ``full`` adds CUDA graphs, perturbations and the backward."""
    torch.manual_seed(0)
    total = sum(LENS)
    cu = cu_of(LENS, dev)
    maxlen = max(LENS)
    q = torch.randn(total, hq, d, dtype=DT, device=dev)
    k = torch.randn(total, hkv, d, dtype=DT, device=dev)
    v = torch.randn(total, hkv, d, dtype=DT, device=dev)
    S = dict(causal=True, num_splits=1)  # the settings both drivers use

    def packed(**kw):
        o, _ = fav(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen, max_seqlen_k=maxlen, **{**S, **kw})
        return o

    t0 = time.time()
    ref = packed()
    sync(dev)
    print(f"first packed call (compile) {time.time() - t0:.1f}s; out {tuple(ref.shape)} {ref.dtype}")
    starts = cu[:-1].tolist()

    @check(tag + "packed run-to-run")
    def _():
        return eq(packed(), ref)

    @check(tag + "packed max_seqlen None (defaults) == packed")
    def _():
        o, _ = fav(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **S)
        return eq(o, ref)

    @check(tag + "alone == packed (each sequence in its own varlen call)")
    def _():
        ok = True
        for b, n in enumerate(LENS):
            s = starts[b]
            c = torch.tensor([0, n], dtype=torch.int32, device=dev)
            o, _ = fav(
                q[s : s + n],
                k[s : s + n],
                v[s : s + n],
                cu_seqlens_q=c,
                cu_seqlens_k=c,
                max_seqlen_q=n,
                max_seqlen_k=n,
                **S,
            )
            ok &= eq(o, ref[s : s + n], f"seq {b} (len {n})")
        return ok

    @check(tag + "alone dense (flash_attn_func, batch 1) == packed")
    def _():
        ok = True
        for b, n in enumerate(LENS[:3]):
            s = starts[b]
            o, _ = fi.flash_attn_func(q[None, s : s + n], k[None, s : s + n], v[None, s : s + n], **S)
            ok &= eq(o[0], ref[s : s + n], f"seq {b}")
        return ok

    @check(tag + "pack_gqa=False == pack_gqa default (True for GQA)")
    def _():
        return eq(packed(pack_gqa=False), ref)

    def make_cache(page):
        """[num_pages, page, Hkv, d] caches (zeros, then each sequence's K/V), pages shuffled; int32 page table."""
        npages = [-(-n // page) for n in LENS]
        width = max(npages)
        num_pages = sum(npages) + 3
        perm = torch.randperm(num_pages, device=dev)
        kc = torch.zeros(num_pages, page, hkv, d, dtype=DT, device=dev)
        vc = torch.zeros_like(kc)
        table = torch.zeros(len(LENS), width, dtype=torch.int32, device=dev)
        i = 0
        for b, n in enumerate(LENS):
            ids = perm[i : i + npages[b]]
            i += npages[b]
            table[b, : npages[b]] = ids.int()
            pos = torch.arange(n, device=dev)
            rows = ids[pos // page] * page + pos % page
            kc.view(-1, hkv, d)[rows] = k[starts[b] : starts[b] + n]
            vc.view(-1, hkv, d)[rows] = v[starts[b] : starts[b] + n]
        return kc, vc, table

    def paged(qq, kc, vc, table, cu_q, seqused, max_q, **kw):
        o, _ = fav(
            qq, kc, vc, cu_seqlens_q=cu_q, seqused_k=seqused, page_table=table, max_seqlen_q=max_q, **{**S, **kw}
        )
        return o

    lens_t = torch.tensor(LENS, dtype=torch.int32, device=dev)
    last_rows = (cu[1:] - 1).long()
    cu_dec = torch.arange(len(LENS) + 1, dtype=torch.int32, device=dev)
    # chunked prefill: the second part of each sequence (from position n//2) against its whole prefix
    first = [n // 2 for n in LENS]
    chunk_n = [n - f for n, f in zip(LENS, first, strict=True)]
    cu_ch = cu_of(chunk_n, dev)
    ch_rows = torch.cat([torch.arange(s + f, s + n, device=dev) for s, f, n in zip(starts, first, LENS, strict=True)])
    # mixed step: even sequences decode (last token), odd ones bring their chunk
    mix_n = [1 if b % 2 == 0 else chunk_n[b] for b in range(len(LENS))]
    cu_mix = cu_of(mix_n, dev)
    mix_rows = torch.cat(
        [torch.arange(s + n - m, s + n, device=dev) for s, n, m in zip(starts, LENS, mix_n, strict=True)]
    )

    def page_checks(page):
        kc, vc, table = make_cache(page)

        @check(tag + f"paged decode == packed last rows (page {page})")
        def _():
            return eq(paged(q[last_rows], kc, vc, table, cu_dec, lens_t, 1), ref[last_rows])

        @check(tag + f"chunked prefill (2nd half vs paged prefix) == packed (page {page})")
        def _():
            return eq(paged(q[ch_rows], kc, vc, table, cu_ch, lens_t, max(chunk_n)), ref[ch_rows])

        @check(tag + f"mixed step (decode + chunks) == packed (page {page})")
        def _():
            return eq(paged(q[mix_rows], kc, vc, table, cu_mix, lens_t, max(mix_n)), ref[mix_rows])

        @check(tag + f"paged decode, max_seqlen_q None, int64 table rejected? (page {page})")
        def _():
            o = paged(q[last_rows], kc, vc, table, cu_dec, lens_t, None)
            ok = eq(o, ref[last_rows])
            try:
                paged(q[last_rows], kc, vc, table.long(), cu_dec, lens_t, 1)
                print("    int64 page_table accepted")
            except Exception as e:
                print(f"    int64 page_table refused: {type(e).__name__}: {e}")
            return ok

        @check(tag + f"paged decode, wider table (+5 unused cols of page 0) == packed (page {page})")
        def _():
            wide = torch.cat([table, torch.zeros(table.shape[0], 5, dtype=torch.int32, device=dev)], 1).contiguous()
            return eq(paged(q[last_rows], kc, vc, wide, cu_dec, lens_t, 1), ref[last_rows])

    for page in pages:
        page_checks(page)

    # ---- backward
    dout = torch.randn_like(ref)

    def fwd_bwd(det):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o, _ = fav(
            qq,
            kk,
            vv,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=maxlen,
            max_seqlen_k=maxlen,
            deterministic=det,
            **S,
        )
        o.backward(dout)
        return o.detach(), qq.grad, kk.grad, vv.grad

    res: dict = {}

    @check(tag + "bwd deterministic=True: fwd out == packed, grads run-to-run bitwise (3 runs)")
    def _():
        runs = [fwd_bwd(True) for _ in range(3)]
        res["det"] = runs[0]
        ok = eq(runs[0][0], ref, "fwd out with grad")
        for r in runs[1:]:
            for name, a, b in zip(("dq", "dk", "dv"), runs[0][1:], r[1:], strict=True):
                ok &= eq(a, b, name)
        return ok

    @check(tag + "bwd deterministic=False: grads run-to-run (3 runs) / == deterministic")
    def _():
        runs = [fwd_bwd(False) for _ in range(3)]
        same_rr = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0][1:], r[1:], strict=True))
        same_det = "det" in res and all(torch.equal(a, b) for a, b in zip(runs[0][1:], res["det"][1:], strict=True))
        return f"run-to-run equal {same_rr}; equal to deterministic {same_det}"

    @check(tag + "bwd deterministic: sequence alone == its rows of the packed grads")
    def _():
        if "det" not in res:
            return "no deterministic run"
        ok = True
        for b in (0, 3):
            s, n = starts[b], LENS[b]
            qq, kk, vv = (t[s : s + n].detach().clone().requires_grad_(True) for t in (q, k, v))
            c = torch.tensor([0, n], dtype=torch.int32, device=dev)
            o, _ = fav(
                qq, kk, vv, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=n, max_seqlen_k=n, deterministic=True, **S
            )
            o.backward(dout[s : s + n])
            for name, a, bb in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), res["det"][1:], strict=True):
                ok &= eq(a, bb[s : s + n], f"seq {b} {name}")
        return ok

    @check(tag + "bwd vs fp32 reference (sanity, max |d| of dq on seq 1)")
    def _():
        if "det" not in res:
            return "no deterministic run"
        s, n = starts[1], LENS[1]
        qq, kk, vv = (t[s : s + n].float().detach().requires_grad_(True) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qq.transpose(0, 1),
            kk.repeat_interleave(hq // hkv, 1).transpose(0, 1),
            vv.repeat_interleave(hq // hkv, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        o.backward(dout[s : s + n].float())
        return (
            f"fwd max|d| {(o - ref[s : s + n].float()).abs().max().item():.3e}, "
            f"dq max|d| {(qq.grad - res['det'][1][s : s + n].float()).abs().max().item():.3e}"
        )

    if not full:
        return
    page = pages[0]
    kc, vc, table = make_cache(page)

    @check(tag + f"CUDA graph: paged decode captured, replayed on new inputs == eager (page {page})")
    def _():
        sq = q[last_rows].clone()
        st = table.clone()
        sl = lens_t.clone()
        if dev.type != "cuda":
            return "skipped (not CUDA)"
        paged(sq, kc, vc, st, cu_dec, sl, 1)  # warm-up / compile outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = paged(sq, kc, vc, st, cu_dec, sl, 1)
        g.replay()
        ok = eq(out, ref[last_rows], "replay 1")
        # new content: decode the token before the last one (context - 1) of every sequence
        rows2 = torch.clamp(last_rows - 1, min=0)
        sl.copy_(torch.clamp(lens_t - 1, min=1))
        sq.copy_(q[rows2])
        g.replay()
        lens2 = torch.clamp(lens_t - 1, min=1)
        eager = paged(q[rows2], kc, vc, table, cu_dec, lens2, 1)
        ok &= eq(out, eager, "replay 2 vs eager")
        return ok

    @check(tag + "CUDA graph: packed varlen fwd captured == eager")
    def _():
        if dev.type != "cuda":
            return "skipped (not CUDA)"
        g = torch.cuda.CUDAGraph()
        packed()
        with torch.cuda.graph(g):
            out = packed()
        g.replay()
        return eq(out, ref)

    @check(tag + "perturbation num_splits=2 in paged decode (differs or refused?)")
    def _():
        try:
            o = paged(q[last_rows], kc, vc, table, cu_dec, lens_t, 1, num_splits=2)
        except Exception as e:
            return f"refused: {type(e).__name__}: {str(e)[:200]}"
        return f"ran; equal to packed: {torch.equal(o, ref[last_rows])}"

    @check(tag + "perturbation tile_mn=(128, 64) via _flash_attn_fwd in paged decode (differs?)")
    def _():
        o = fi._flash_attn_fwd(
            q[last_rows],
            kc,
            vc,
            cu_seqlens_q=cu_dec,
            seqused_k=lens_t,
            page_table=table,
            max_seqlen_q=1,
            causal=True,
            num_splits=1,
            tile_mn=(128, 64),
        )[0]
        return f"ran; equal to packed: {torch.equal(o, ref[last_rows])}"

    @check(tag + "perturbation tile_mn=(128, 64) via _flash_attn_fwd packed (differs?)")
    def _():
        o = fi._flash_attn_fwd(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=maxlen,
            max_seqlen_k=maxlen,
            causal=True,
            num_splits=1,
            tile_mn=(128, 64),
        )[0]
        return f"ran; equal to packed: {torch.equal(o, ref)}"

    @check(tag + "_flash_attn_fwd(defaults) == flash_attn_varlen_func (same kernel)")
    def _():
        o = fi._flash_attn_fwd(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=maxlen,
            max_seqlen_k=maxlen,
            causal=True,
            num_splits=1,
        )[0]
        return eq(o, ref)


def main() -> None:
    import flash_attn.cute.interface as fi
    from flash_attn.cute.interface import flash_attn_varlen_func as fav

    print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
    dev = torch.device(os.environ.get("FA4_PROBE_DEVICE", "cuda"))  # cpu: a smoke test of this script with a stand-in
    if dev.type == "cuda":
        print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    from importlib import metadata

    for dist in (
        "flash-attn-4",
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-base",
        "quack-kernels",
        "apache-tvm-ffi",
        "cuda-bindings",
    ):
        try:
            print(f"{dist} {metadata.version(dist)}")
        except Exception as e:
            print(f"{dist}: {type(e).__name__} {e}")
    print("flash_attn.cute.interface at", fi.__file__)
    print("flash_attn_varlen_func" + str(inspect.signature(fav)))
    print("_flash_attn_fwd" + str(inspect.signature(fi._flash_attn_fwd)))
    print("_flash_attn_bwd" + str(inspect.signature(fi._flash_attn_bwd)))
    print("SM90 fwd tile (hd128, causal):", fi._tile_size_fwd_sm90(D, D, True, False))
    try:
        print("SM90 bwd tile (hd128, causal):", fi._tile_size_bwd_sm90(D, D, True, False))
    except Exception as e:
        print("bwd tile:", e)

    probe(fi, fav, dev, HQ, HKV, D, PAGES, full=True, tag="")
    # the committed tiny checkpoints' attention shape (contracts run it): GQA 4/2, head_dim 16
    probe(fi, fav, dev, 4, 2, 16, [16], full=False, tag="[tiny 4/2/16] ")
    print("\nSUMMARY")
    for name, status in RESULTS:
        print(f"  {status.split()[0]:6s} {name}")


if __name__ == "__main__":
    main()
