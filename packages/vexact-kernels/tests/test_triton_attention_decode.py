"""The candidate decode launch forms (``triton_ops/attention_decode.py``) against the op's decode: torch.equal on CPU
through the interpreter (where every form's MMA is the same broadcast product summed in one order); on the GPU a
table of which forms give the op's bits (``-m gpu``; asserted only for the forms the op launches: none yet).
"""

from __future__ import annotations

import random

import pytest
import torch

from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")

# The candidates the op launches at decode: their bits must equal the op's. None yet; the GPU test reports the others.
OP_FORMS: tuple[str, ...] = ()


def _mods():
    from vexact_kernels.triton_ops import attention, attention_decode

    return attention, attention_decode


def _decode_step(lens, hq, hkv, dims, page, seed, device):
    """A decode step: sequence ``b`` holds ``lens[b]`` keys in shuffled pages of a cache filled with random rows (the
    rows past a context too: the kernels must not read them), one query each. Returns the public op's arguments
    ``(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)`` and ``attention._fwd``'s."""
    ta, _ = _mods()
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 2, generator=g)
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int64)
    used = 0
    for b, n in enumerate(pages):
        bt[b, :n] = order[used : used + n]
        used += n
    kc = torch.randn(sum(pages) + 2, page, hkv, dims[0], generator=g).bfloat16()
    vc = torch.randn(sum(pages) + 2, page, hkv, dims[1], generator=g).bfloat16()
    used = torch.zeros(sum(pages) + 2, page, dtype=torch.bool)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        used[bt[b, pos // page], pos % page] = True
    kc[~used], vc[~used] = float("nan"), float("inf")  # never read, or read and discarded (a masked score)
    kc, vc = kc.to(device), vc.to(device)
    q = torch.randn(len(lens), hq, dims[0], generator=g).bfloat16().to(device)
    ctx = torch.tensor(lens, device=device)
    cuq = torch.arange(len(lens) + 1, device=device)
    paged = (q, kc, vc, bt.to(device), ctx, cuq)
    lay = ta.paged_layout(bt, ctx, cuq, page, q.shape[0], hq, hkv, q.device)
    args = (q, kc.flatten(0, 1), vc.flatten(0, 1), lay.table, page, lay.q_start, lay.n_q, lay.ctx, 0.125)
    return paged, args


def _op_outputs(paged, args):
    """The op's output (its own launch for this size) and its 16-row one-warp decode launch's, which must agree."""
    ta, _ = _mods()
    op = ta.attention_paged(*paged, 0.125)
    m16 = ta._fwd(*args, False, split_programs=False, launch=(ta.DECODE_BLOCK_M, ta.DECODE_NUM_WARPS, ta.NUM_STAGES))
    assert torch.equal(op, m16[0])
    return op


# (context lengths, query heads, KV heads, (dk, dv), page): batches of 1-4, contexts of 1, across page boundaries
# (16/17, 33) and the 512-key split boundary (512/513, 530, 600, 1030: 3 splits), GQA groups 2/4/8, head dims 64/128,
# pages of 16 (a tile over four pages), 32, 128 (a tile inside one page) and 3 (one table entry per key).
CASES = [
    ([1], 2, 1, (64, 64), 16),
    ([17, 512, 513, 1], 8, 2, (64, 64), 16),
    ([1030, 16, 600], 16, 2, (128, 128), 16),
    ([530, 33], 16, 8, (128, 128), 16),
    ([70, 520], 4, 1, (64, 64), 32),
    ([600, 200], 8, 2, (64, 64), 128),
    ([700, 1], 8, 1, (64, 64), 3),
    ([520, 9], 4, 2, (48, 32), 16),
]


@interp
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}:{c[2]}-d{c[3][0]}-p{c[4]}")
def test_interpreted_candidates_equal_the_op(case):
    lens, hq, hkv, dims, page = case
    _, dec = _mods()
    paged, args = _decode_step(lens, hq, hkv, dims, page, seed=len(lens) + hq, device="cpu")
    op = _op_outputs(paged, args)
    assert op.isfinite().all()
    ran = 0
    for form in dec.FORMS:
        if dec.unsupported(form, page, *dims):
            continue
        out = dec.decode_attention(form, *args)
        assert torch.equal(out, op), (form, (out.float() - op.float()).abs().max())
        ran += 1
    assert ran >= 3


@interp
def test_interpreted_int64_offsets_give_the_same_bits(monkeypatch):
    """The int64 offsets (a cache whose largest offset passes int32) compute the same rows as the int32 ones."""
    _, dec = _mods()
    paged, args = _decode_step([530, 40], 8, 2, (64, 64), 16, seed=7, device="cpu")
    op = _op_outputs(paged, args)
    monkeypatch.setattr(dec, "offsets_fit_int32", lambda *caches: False)
    for form in dec.FORMS:
        if form != "tma":  # no offsets: descriptors
            assert torch.equal(dec.decode_attention(form, *args), op), form


def test_offsets_fit_int32_checks_the_largest_offset():
    _, dec = _mods()
    fits = torch.empty(2**21, 8, 128, device="meta")  # largest offset 2**31 - 1
    over = torch.empty(2**21 + 1, 8, 128, device="meta")
    assert dec.offsets_fit_int32(fits, fits) and not dec.offsets_fit_int32(fits, over)
    assert not dec.offsets_fit_int32(torch.empty(2**24, 8, 128, device="meta")[:, 4:])  # strides, not shape


def test_decode_attention_refuses_other_steps():
    _, dec = _mods()
    q, rows = torch.zeros(2, 32, 8, dtype=torch.bfloat16), torch.zeros(16, 1, 8, dtype=torch.bfloat16)
    seq = torch.zeros(2, dtype=torch.int32)
    args = (rows, rows, torch.zeros(2, 1, dtype=torch.int32), 16, seq, seq + 1, seq + 1, 1.0)
    with pytest.raises(ValueError, match="unknown form 'tma2'"):
        dec.decode_attention("tma2", q, *args)
    with pytest.raises(ValueError, match="pages of 16, 32 or a multiple of 64 keys; got 3"):
        dec.decode_attention("tma", q[:, :2], rows, rows, *args[2:3], 3, *args[4:])
    with pytest.raises(ValueError, match="power-of-2 head dims; got 48/64"):
        dec.decode_attention("tma", torch.zeros(2, 2, 48), rows.new_zeros(16, 1, 48), torch.zeros(16, 1, 64), *args[2:])
    with pytest.raises(ValueError, match="at most 16"):
        dec.decode_attention("addr32", q, *args)
    with pytest.raises(ValueError, match="one per sequence"):
        dec.decode_attention("addr32", q[:, :4].repeat(2, 1, 1), *args)


@pytest.mark.gpu
def test_gpu_decode_candidates_bits():
    """Each candidate against the op at its decode launch (16-row tiles in one warp: enough programs), the GQA groups
    of Qwen3-1.7B / 8B / 30B-A3B, a group of 16 and an MLA head, pages of 16 and 32, contexts past many splits:
    which forms give the op's bits (torch.equal), printed as a table (``-rP`` shows it); a form that errors fails the
    test; only the forms in ``OP_FORMS`` must be equal."""
    ta, dec = _mods()
    shapes = [(16, 8, (128, 128)), (32, 8, (128, 128)), (32, 4, (128, 128)), (64, 4, (128, 128)),
              (16, 1, (192, 128))]  # fmt: skip
    results, errors = {}, []
    for hq, hkv, dims in shapes:
        for page in (16, 32):
            rng = random.Random(hq * 100 + hkv + page)
            nseq = -(-ta.DECODE_MIN_PROGRAMS // hkv)
            lens = [rng.randint(1, 4100) if rng.random() < 0.125 else rng.randint(1, 1200) for _ in range(nseq)]
            lens[:4] = [1, 512, 513, 4096]
            paged, args = _decode_step(lens, hq, hkv, dims, page, seed=hq + page, device="cuda")
            lay = ta.paged_layout(*paged[3:], page, len(lens), hq, hkv, torch.device("cuda"))
            assert lay.launch == (ta.DECODE_BLOCK_M, ta.DECODE_NUM_WARPS, ta.NUM_STAGES)
            op = _op_outputs(paged, args)
            for form in dec.FORMS:
                key = (f"{hq}:{hkv} d{dims[0]}/{dims[1]} page {page}", form)
                if dec.unsupported(form, page, *dims):
                    results[key] = "n/a"
                    continue
                try:
                    out = dec.decode_attention(form, *args)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001  (every form is tried; the test fails below)
                    errors.append(f"{key}: {type(e).__name__}: {e}")
                    results[key] = "error"
                    continue
                same = torch.equal(out, op)
                results[key] = "equal" if same else f"differs (max {(out.float() - op.float()).abs().max():.3g})"
    cases = list(dict.fromkeys(k[0] for k in results))
    print("\n| case | " + " | ".join(dec.FORMS) + " |\n" + "|---" * (1 + len(dec.FORMS)) + "|")
    for c in cases:
        print(f"| {c} | " + " | ".join(results[(c, f)] for f in dec.FORMS) + " |")
    assert not errors, "\n".join(errors)
    assert len(results) == len(shapes) * 2 * len(dec.FORMS)
    assert all(results[(c, f)] == "equal" for c in cases for f in OP_FORMS)
