"""Triton fused logprobs / entropy and row log_softmax: on CPU through the interpreter (small shapes), on the GPU at
real shapes.

Checks: float64-reference accuracy, agreement with the unfused logits + log_softmax path, bitwise independence of a
row's logprob from the other rows and from chunking, backward against float64 autograd, run-to-run determinism.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
EPS = 1e-6


def _ops():
    from vexact_kernels.triton_ops import logprobs

    return logprobs


def _problem(t, h, v, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = (3 * torch.randn(t, h, generator=g)).to(dtype)
    norm_w = (1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    head = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (t,), generator=g)
    temps = 0.5 + torch.rand(t, generator=g)
    return (x.to(device) for x in (hidden, norm_w, head, targets, temps))


def _reference(normed, head, targets, temps):
    """float64 ``(logprob, entropy)``; differentiable in ``normed`` and ``head``."""
    logp = torch.log_softmax((normed.double() @ head.double().T) / temps.double()[:, None], dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _grads(normed, head, targets, temps, glp, gent, fn):
    n, w = normed.detach().clone().requires_grad_(), head.detach().clone().requires_grad_()
    lp, ent = fn(n, w, targets, temps)
    loss = (lp * glp).sum() + ((ent * gent).sum() if gent is not None else 0.0)
    loss.backward()
    return n.grad, w.grad


@interp
@pytest.mark.parametrize("split_tiles", [None, 1])
def test_interpreted_fused_matches_float64(split_tiles, monkeypatch):
    ops = _ops()
    if split_tiles:  # several vocabulary splits at a small V: exercises the split fold
        monkeypatch.setattr(ops, "LOGPROBS_SPLIT_TILES", split_tiles)
    hidden, _, head, targets, temps = _problem(9, 80, 300 if split_tiles else 1100, seed=1)
    assert ops.n_vocab_splits(head.shape[0]) >= 2
    lp, ent = ops.triton_logprobs(hidden, head, targets, temps, with_entropy=True)
    ref_lp, ref_ent = _reference(hidden, head, targets, temps)
    # products of bf16 inputs are exact in fp32: only fp32 summation and exp/log rounding remain
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)
    lp_only, none = ops.triton_logprobs(hidden, head, targets, temps, with_entropy=False)
    assert none is None and torch.equal(lp_only, lp)


@interp
def test_interpreted_fused_matches_unfused_log_softmax():
    ops = _ops()
    hidden, _, head, targets, temps = _problem(7, 64, 200, seed=2)
    lp, ent = ops.triton_logprobs(hidden, head, targets, temps, with_entropy=True)
    logp = ops.triton_log_softmax(hidden.float() @ head.float().T, temps)
    torch.testing.assert_close(lp, logp.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1), rtol=0, atol=2e-5)


@interp
@settings(max_examples=8, deadline=None)
@given(t=st.integers(1, 70), seed=st.integers(0, 2**16), data=st.data())
def test_interpreted_row_independent_of_batch_and_chunking(t, seed, data):
    ops = _ops()
    hidden, _, head, targets, temps = _problem(t, 40, 150, seed=seed)
    lp, ent = ops.triton_logprobs(hidden, head, targets, temps, with_entropy=True)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=8), label="rows"))
    sub_lp, sub_ent = ops.triton_logprobs(hidden[rows], head, targets[rows], temps[rows], with_entropy=True)
    assert torch.equal(sub_lp, lp[rows]) and torch.equal(sub_ent, ent[rows])
    step = data.draw(st.integers(max(1, t // 3), t), label="chunk")
    parts = [
        ops.triton_logprobs(h, head, tg, tp, with_entropy=True)
        for h, tg, tp in zip(hidden.split(step), targets.split(step), temps.split(step), strict=True)
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), lp) and torch.equal(torch.cat([p[1] for p in parts]), ent)


@interp
@pytest.mark.parametrize("with_entropy_grad", [False, True])
def test_interpreted_backward_matches_float64_and_is_deterministic(with_entropy_grad, monkeypatch):
    ops = _ops()
    monkeypatch.setattr(ops, "LOGPROBS_BWD_CHUNK", 16)  # several backward chunks: d W accumulates across them
    hidden, _, head, targets, temps = _problem(40, 64, 150, seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    glp = torch.randn(40, generator=g)
    gent = torch.randn(40, generator=g) if with_entropy_grad else None

    def fused(n, w, tg, tp):
        return ops.triton_logprobs(n, w, tg, tp, with_entropy=True)

    dh, dw = _grads(hidden, head, targets, temps, glp, gent, fused)
    rdh, rdw = _grads(hidden.double(), head.double(), targets, temps, glp.double(),
                      None if gent is None else gent.double(), _reference)  # fmt: skip
    torch.testing.assert_close(dh.double(), rdh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-4, atol=1e-5)
    dh2, dw2 = _grads(hidden, head, targets, temps, glp, gent, fused)
    assert torch.equal(dh, dh2) and torch.equal(dw, dw2)


@interp
def test_interpreted_bf16_backward_dtypes_and_tolerance():
    ops = _ops()
    hidden, _, head, targets, temps = _problem(20, 64, 130, seed=5)
    glp = torch.randn(20, generator=torch.Generator().manual_seed(6))
    dh, dw = _grads(hidden, head, targets, temps, glp, None, lambda *a: ops.triton_logprobs(*a, with_entropy=False))
    assert dh.dtype == dw.dtype == torch.bfloat16
    rdh, rdw = _grads(hidden.double(), head.double(), targets, temps, glp.double(), None, _reference)
    # the logits gradient is rounded to bf16 before the two backward matmuls (tensor-core operands)
    for got, ref in ((dh, rdh), (dw, rdw)):
        err = (got.double() - ref).norm() / ref.norm()
        assert err < 1e-2, f"relative error {err:.3g}"


@interp
def test_interpreted_log_softmax_accuracy_extremes_and_row_invariance():
    ops = _ops()
    logits = 5 * torch.randn(6, 1500, generator=torch.Generator().manual_seed(7))
    temps = torch.tensor([1.0, 0.6, 1.7, 1.0, 0.3, 2.0])
    out = ops.triton_log_softmax(logits, temps)
    ref = torch.log_softmax(logits.double() / temps.double()[:, None], dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.triton_log_softmax(logits[[4, 1]], temps[[4, 1]]), out[[4, 1]])
    extreme = torch.tensor([[1e30, 0.0, -1e30], [0.0, -torch.inf, 0.0]])
    out = ops.triton_log_softmax(extreme, torch.ones(2))
    assert out[0, 0] == 0.0 and out[0, 1] < -1e29 and out[0, 2] < -1e29
    torch.testing.assert_close(out[1, [0, 2]], torch.full((2,), -0.6931472))
    assert out[1, 1] == -torch.inf


# GPU: Qwen3-like shapes. V is the real vocabulary; H = 2048 (Qwen3-1.7B).
GPU_H, GPU_V = 2048, 151936


def _gpu_problem(t, seed=0):
    return _problem(t, GPU_H, GPU_V, seed=seed, device="cuda")


@pytest.mark.gpu
def test_gpu_fused_rows_equal_single_row_results_for_any_batch():
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 2, 63, 64, 65, 1000, 16384] + torch.randint(1, 16385, (2,), generator=gen).tolist()
    hidden, norm_w, head, targets, temps = _gpu_problem(max(sizes), seed=1)
    probe = torch.cat([torch.arange(70), torch.randint(70, max(sizes), (58,), generator=gen)]).cuda()
    singles = {
        int(i): vk.logprobs_from_hidden(
            hidden[i : i + 1], norm_w, EPS, head, targets[i : i + 1], temps[i : i + 1], with_entropy=True
        )  # fmt: skip
        for i in probe.tolist()
    }
    for m in sizes:
        lp, ent = vk.logprobs_from_hidden(hidden[:m], norm_w, EPS, head, targets[:m], temps[:m], with_entropy=True)
        for i in [i for i in probe.tolist() if i < m]:
            assert torch.equal(lp[i : i + 1], singles[i][0]) and torch.equal(ent[i : i + 1], singles[i][1]), (m, i)
    # random row subsets, and chunk_size never changes a value
    full, _ = vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, temps)
    for _ in range(3):
        rows = torch.randperm(hidden.shape[0], generator=gen)[: int(torch.randint(1, 3000, (1,), generator=gen))]
        rows = rows.cuda()
        sub, _ = vk.logprobs_from_hidden(hidden[rows], norm_w, EPS, head, targets[rows], temps[rows])
        assert torch.equal(sub, full[rows])
    # the engine asks for logprobs only, the trainer may ask for entropy too, or record autograd: same bits
    lp_ent, _ = vk.logprobs_from_hidden(
        hidden[:3000], norm_w, EPS, head, targets[:3000], temps[:3000], with_entropy=True
    )
    lp_grad, _ = vk.logprobs_from_hidden(hidden[:3000].clone().requires_grad_(), norm_w, EPS, head, targets[:3000],
                                         temps[:3000])  # fmt: skip
    assert torch.equal(lp_ent, full[:3000]) and torch.equal(lp_grad.detach(), full[:3000])
    for chunk in (1, 7, 1024, 100000):
        lp, _ = vk.logprobs_from_hidden(
            hidden[:3000], norm_w, EPS, head, targets[:3000], temps[:3000], chunk_size=chunk
        )
        assert torch.equal(lp, full[:3000])


@pytest.mark.gpu
def test_gpu_fused_matches_unfused_and_float64():
    hidden, norm_w, head, targets, temps = _gpu_problem(512, seed=2)
    lp, ent = vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, temps, with_entropy=True)
    normed = vk.rms_norm(hidden, norm_w, EPS)
    ref_lp, ref_ent = _reference(normed, head, targets, temps)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-3)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-3)
    # the engine's unfused path: invariant logits (Triton matmul) then the Triton log_softmax
    logp = vk.log_softmax(vk.compute_logits(hidden, norm_w, EPS, head), temps)
    torch.testing.assert_close(lp, logp.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=1e-3)
    torch.testing.assert_close(ent, vk.entropy_from_logprobs(logp), rtol=0, atol=1e-3)
    # and the Triton log_softmax against torch's on the same logits
    logits = normed.float() @ head.float().T
    torch.testing.assert_close(vk.log_softmax(logits, temps), torch.log_softmax(logits / temps[:, None], -1),
                               rtol=0, atol=1e-4)  # fmt: skip


@pytest.mark.gpu
def test_gpu_log_softmax_rows_equal_single_row_results():
    gen = torch.Generator().manual_seed(3)
    logits = (5 * torch.randn(4096, GPU_V, generator=gen)).cuda()
    temps = (0.5 + torch.rand(4096, generator=gen)).cuda()
    full = vk.log_softmax(logits, temps)
    for i in torch.randint(0, 4096, (64,), generator=gen).tolist():
        assert torch.equal(vk.log_softmax(logits[i : i + 1], temps[i : i + 1]), full[i : i + 1])
    for m in (1, 17, 1000):
        assert torch.equal(vk.log_softmax(logits[:m], temps[:m]), full[:m])


@pytest.mark.gpu
def test_gpu_backward_matches_float64_and_is_deterministic():
    t = 3000  # more than one backward chunk
    hidden, norm_w, head, targets, temps = _gpu_problem(t, seed=4)
    g = torch.Generator().manual_seed(5)
    glp, gent = torch.randn(t, generator=g).cuda(), torch.randn(t, generator=g).cuda()

    def run():
        h = hidden.clone().requires_grad_()
        nw, w = norm_w.clone().requires_grad_(), head.clone().requires_grad_()
        lp, ent = vk.logprobs_from_hidden(h, nw, EPS, w, targets, temps, with_entropy=True)
        ((lp * glp).sum() + (ent * gent).sum()).backward()
        return h.grad, nw.grad, w.grad

    first, second = run(), run()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    hd = hidden.double().requires_grad_()
    nwd, wd = norm_w.double().requires_grad_(), head.double().requires_grad_()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * nwd
    lp, ent = _reference(normed, wd, targets, temps)
    ((lp * glp.double()).sum() + (ent * gent.double()).sum()).backward()
    for got, ref in zip(first, (hd.grad, nwd.grad, wd.grad), strict=True):
        err = (got.double() - ref).norm() / ref.norm()
        assert err < 2e-2, f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False])
def test_gpu_backward_tile_is_speed_only(monkeypatch, tma):
    """The logits-gradient kernel's tile (``LOGPROBS_BWD_*``) changes no bit of any gradient: the backward's own tile
    against the forward's (64 x 128, 4 warps) and a wide one, through TMA descriptors and through pointers."""
    from vexact_kernels.triton_ops import logprobs as ops

    monkeypatch.setattr(ops, "LOGPROBS_TMA", tma)
    t = 4500  # two backward chunks
    hidden, norm_w, head, targets, temps = _gpu_problem(t, seed=21)
    g = torch.Generator().manual_seed(22)
    glp, gent = torch.randn(t, generator=g).cuda(), torch.randn(t, generator=g).cuda()

    def run(block_t, block_v, warps):
        monkeypatch.setattr(ops, "LOGPROBS_BWD_BLOCK_T", block_t)
        monkeypatch.setattr(ops, "LOGPROBS_BWD_BLOCK_V", block_v)
        monkeypatch.setattr(ops, "LOGPROBS_BWD_NUM_WARPS", warps)
        h = hidden.clone().requires_grad_()
        nw, w = norm_w.clone().requires_grad_(), head.clone().requires_grad_()
        lp, ent = vk.logprobs_from_hidden(h, nw, EPS, w, targets, temps, with_entropy=True)
        ((lp * glp).sum() + (ent * gent).sum()).backward()
        return h.grad, nw.grad, w.grad

    ours = run(ops.LOGPROBS_BWD_BLOCK_T, ops.LOGPROBS_BWD_BLOCK_V, ops.LOGPROBS_BWD_NUM_WARPS)
    for cfg in ((ops.LOGPROBS_BLOCK_T, ops.LOGPROBS_VOCAB_BLOCK, ops.LOGPROBS_NUM_WARPS), (64, 256, 8)):
        for a, b in zip(ours, run(*cfg), strict=True):
            assert torch.equal(a, b), cfg


@pytest.mark.gpu
def test_gpu_tma_tiles_give_the_bits_of_pointer_tiles(monkeypatch):
    """``LOGPROBS_TMA`` is speed only: the logits tiles read through TMA descriptors give the pointer loads' logprobs,
    entropies, gradients and draws bit for bit (scoring at several T, the backward over two chunks, the draw at the
    small-T draw rows, one row block, several and a T above ``SAMPLE_CHUNK_ROWS``), on random and on peaked rows."""
    from vexact_kernels.triton_ops import logprobs as ops

    hidden, norm_w, head, targets, temps = _gpu_problem(4200, seed=11)
    hidden[:300:3] *= 16  # peaked rows: the draw skips tiles
    seeds = torch.randint(0, 2**62, (4200,), generator=torch.Generator().manual_seed(12)).cuda()
    glp = torch.randn(4200, generator=torch.Generator().manual_seed(13)).cuda()

    def run():
        out = {}
        for t in (1, 5, 16, 64, 200, 300):
            out[f"score {t}"] = vk.logprobs_from_hidden(
                hidden[:t], norm_w, EPS, head, targets[:t], temps[:t], with_entropy=True
            )  # fmt: skip
            out[f"draw {t}"] = vk.sample_from_hidden(hidden[:t], norm_w, EPS, head, temps[:t], seeds[:t])
        h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
        lp, _ = vk.logprobs_from_hidden(h, norm_w, EPS, w, targets, temps)
        (lp * glp).sum().backward()
        out["backward"] = (lp.detach(), h.grad, w.grad)
        return out

    assert ops.LOGPROBS_TMA and torch.cuda.get_device_capability()[0] >= 9, "the TMA path is what runs here"
    monkeypatch.setattr(ops, "LOGPROBS_TMA_MIN_ROWS", 1)  # T = 1 through TMA too
    with vk.use_backend("invariant"):
        tma = run()
        monkeypatch.setattr(ops, "LOGPROBS_TMA", False)
        pointers = run()
    for key, got in tma.items():
        for a, b in zip(got, pointers[key], strict=True):
            assert torch.equal(a, b), key


@pytest.mark.gpu
def test_gpu_host_columns_go_over_whatever_their_strides():
    """Per-row host columns reach the GPU through pinned memory: a broadcast one (a single temperature expanded to
    every row, stride 0) and a strided one too, with their values."""
    ops = _ops()
    dev = torch.device("cuda")
    wide = torch.arange(10, dtype=torch.int64)
    for col, want in (
        (torch.tensor(0.7).expand(5), torch.full((5,), 0.7)),
        (wide[::2], wide[::2].float()),
    ):
        got = ops.rows_on(col, dev, torch.float32)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
