"""Every contract must be seen failing: one documented perturbation per op family, and the named contract it breaks.

Each test applies a perturbation to a kernel op (monkeypatched for the test only), runs a contract, and asserts that
the contract fails, after checking that it holds unperturbed (so a failure here is the perturbation's doing, never a
fixture that no longer reproduces on this machine). The contracts:

* **golden[<checkpoint>]**: the golden fixture of a committed tiny checkpoint (``contracts/golden.py``), in its quick
  form: the trainer's logprobs and entropy of the fixture's recorded rollouts (``golden.rescore``: one packed forward,
  0.2-3 s on CPU) must reproduce ``trainer_logprobs`` and ``trainer_entropy`` bitwise. Those tensors are part of the
  full fixture, so a perturbation that breaks the quick form breaks ``test_golden.py::test_golden_reproduces``.
* **batch invariance**: ``row_invariance_violations`` of ``test_batch_invariance.py`` (a row alone == in the batch).

Each row: op family; the perturbation; the contract that fails; how many of the fixture's 192 trainer logprobs
change on CPU (``python -m pytest contracts/test_perturbations.py``; 2026-11-27, torch 2.13.0+cpu, Intel Xeon with
AVX-512; the count tells how far from a silent miss each case is).

- matmul: K reduced in reversed order (both operands flipped along K) -> golden[qwen3_moe_top8], 177
- matmul: the K order chosen by M (reversed when a call has more than 8 rows, as a split-K switch by M would be)
  -> batch invariance of ``linear`` (fp32 out)
- rms_norm: rounding at another point, the normalised row rounded to bf16 before the weight multiply (transformers'
  Llama order) -> golden[qwen3_hd64], 192
- rms_norm: the sum of squares added left to right, not the pairwise tree (CPU only) -> golden[qwen3_moe_top8], 181
- rotary: rounding at another point, the cos/sin tables rounded to bf16 (as transformers casts them to the
  activations' dtype) -> golden[qwen3_hd64], 192
- attention: key blocks of another size (CPU ``ATTN_BLOCK_N`` 16 -> 32; GPU Triton ``BLOCK_N`` 64 -> 32)
  -> golden[qwen3_hd64], 38
- logprobs: the vocabulary sums (log-sum-exp, entropy) left to right, not the tree (CPU only) -> golden[qwen3_hd64],
  91 (172 entropies)
- logprobs: rounding at another point, the temperature rounded to bf16 before the division -> golden[qwen3_hd64], 96
  (the rows at temperature 0.7 and 1.2; 1.0 is exact in bf16)
- MoE routing: the top-k weights renormalised by their sum in reversed rank order -> golden[qwen3_moe_top8], 40;
  golden[deepseek_v3_top6], 73
- MoE combine: the k expert outputs combined in reversed rank order -> golden[qwen3_moe_top8], 18;
  golden[qwen3_moe_top8_raw], 70; golden[deepseek_v3_top6], 32
- MLA: rounding at another point, the softmax scale (YaRN's mscale included) folded into q and rounded to bf16, the
  kernel run with scale 1 -> golden[deepseek_v3_top6], 192
- attention sinks: each head's sink read in another head order (``[G, Hkv]`` for ``[Hkv, G]``, a GQA mapping slip)
  -> golden[gpt_oss], 192 (the GPU twin on a GPU target's fixture)
- sliding window: its boundary one key further back (``window + 1``) -> golden[gpt_oss], 121 (the tokens past the
  window; the GPU twin too)
- attention sinks, the fold's place: the sink folded in after the last key block instead of before the first, in the
  paged (engine) path alone -> engine == trainer on gpt_oss, 3 of 30 logprobs
  (``test_gpt_oss_engine_equals_trainer_catches_a_paged_only_change``; the same code with the sink first reproduces
  the golden fixture: ``test_gpt_oss_sink_copy_reproduces_the_reference``); the window one key further back in the
  paged path alone -> engine == trainer, 20 of 30

What a contract cannot see, and why the variants exist: with top-2 routing ``a + b == b + a``, so the reversed
combine and the reversed renormalisation change no bit of ``qwen3_moe`` or ``deepseek_v3``
(``test_top2_checkpoints_cannot_see_the_rank_order``); ``qwen3_moe_top8_raw`` does not renormalise, so the reversed
renormalisation is no perturbation there. An fp32 order change whose result is cast to bf16 shows only where a value
sits near a bf16 rounding boundary (about 5e-5 of the MoE combine's outputs) and survives the residual add: the MoE
variants are 512 wide, with loud experts and small embeddings, for that reason (``vexact_models.tiny``). Measured
silent on CPU (0 of 192 logprobs change), so not used as a case: the reversed K order on ``qwen3_hd64`` (its fp32
lm_head reduces K = 64 in two blocks of 32, whose sum commutes, and a reversed pairwise tree adds the same pairs;
elsewhere the change rarely survives a bf16 cast), the sequential sum of squares on ``qwen3_hd64`` (64 wide),
key blocks of 32 on ``qwen3_moe_top8`` (its attention output is small beside the experts'), and the sink folded last
in both paths on ``gpt_oss`` (golden[gpt_oss]: 0 of 192; a one-block softmax adds the same two terms either way, and
the fp32 change rarely survives the cast to bf16 at heads of 16).

The GPU twins (marked ``gpu``) apply the same perturbations on the target's Triton path (where a perturbation lives
inside a CPU function, the GPU twin changes the matching Triton constant, or is CPU only as marked) and check the
target's fixtures.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable

import pytest
import torch

import vexact_kernels as vk
from contracts import golden
from contracts.harness import row_invariance_violations

_VEXACT = ("vexact_kernels", "vexact_models", "vexact_engine", "vexact_trainer")


def _patch_everywhere(monkeypatch, original: Callable, replacement: Callable) -> None:
    """Replace a kernel function under every name a vexact module holds it by (the package's re-export and each
    ``from .x import f``), for this test only."""
    hits = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(_VEXACT):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                monkeypatch.setattr(mod, attr, replacement)
                hits += 1
    assert hits, f"{original.__name__} is bound nowhere"


def _mod(name: str):
    return importlib.import_module(f"vexact_kernels.{name}")  # the package re-exports functions of the same names


# ---- the perturbations: (monkeypatch, device) -> None -------------------------------------------------------------


def matmul_reversed_k(monkeypatch, device):
    real = vk.linear

    def linear(x, weight, bias=None, out_dtype=None):
        return real(x.flip(-1), weight.flip(-1), bias, out_dtype)

    _patch_everywhere(monkeypatch, real, linear)


def matmul_k_order_by_m(monkeypatch, device):
    real = vk.linear

    def linear(x, weight, bias=None, out_dtype=None):
        if x.reshape(-1, x.shape[-1]).shape[0] > 8:
            x, weight = x.flip(-1), weight.flip(-1)
        return real(x, weight, bias, out_dtype)

    _patch_everywhere(monkeypatch, real, linear)


def _norm_rounded_first(real_rms_norm):
    def rms_norm(x, weight, eps, out_dtype=None):
        normed = real_rms_norm(x, torch.ones_like(weight), eps)  # x's dtype: rounded here
        return (normed.float() * weight.float()).to(out_dtype or x.dtype)

    return rms_norm


def rms_norm_rounded_before_weight(monkeypatch, device):
    real_norm, real_pair, real_add = vk.rms_norm, vk.rms_norm_pair, vk.add_rms_norm
    norm = _norm_rounded_first(real_norm)

    def pair(x1, w1, x2, w2, eps, out_dtype=None):
        return norm(x1, w1, eps, out_dtype), norm(x2, w2, eps, out_dtype)

    def add(x, residual, weight, eps):
        s = x + residual
        return s, norm(s, weight, eps)

    _patch_everywhere(monkeypatch, real_norm, norm)
    _patch_everywhere(monkeypatch, real_pair, pair)
    _patch_everywhere(monkeypatch, real_add, add)


def _left_to_right(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    x = x.movedim(dim, -1)
    acc = x[..., 0]
    for i in range(1, x.shape[-1]):
        acc = acc + x[..., i]
    return acc


def rms_norm_sequential_sum(monkeypatch, device):
    monkeypatch.setattr(_mod("rms_norm"), "tree_sum", _left_to_right)


def rotary_bf16_tables(monkeypatch, device):
    real, real_qk = vk.apply_rotary, vk.apply_rotary_qk

    def r(t):
        return t.to(torch.bfloat16).float()

    _patch_everywhere(monkeypatch, real, lambda x, pos, cos, sin: real(x, pos, r(cos), r(sin)))
    _patch_everywhere(monkeypatch, real_qk, lambda q, k, pos, cos, sin: real_qk(q, k, pos, r(cos), r(sin)))


def attention_other_block(monkeypatch, device):
    if device == "cpu":
        monkeypatch.setattr(_mod("attention"), "ATTN_BLOCK_N", 32)
    else:
        monkeypatch.setattr(importlib.import_module("vexact_kernels.triton_ops.attention"), "BLOCK_N", 32)


def logprobs_sequential_sums(monkeypatch, device):
    monkeypatch.setattr(_mod("logprobs"), "tree_sum", _left_to_right)


def logprobs_bf16_temperature(monkeypatch, device):
    real, real_sample = vk.logprobs_from_hidden, vk.sample_from_hidden

    def r(t):
        return torch.as_tensor(t, dtype=torch.float32).to(torch.bfloat16).float()

    def logprobs(
        hidden, norm_weight, eps, lm_head_weight, targets, temperature=1.0, chunk_size=1024, with_entropy=False
    ):
        return real(hidden, norm_weight, eps, lm_head_weight, targets, r(temperature), chunk_size, with_entropy)

    _patch_everywhere(monkeypatch, real, logprobs)
    _patch_everywhere(monkeypatch, real_sample, lambda h, nw, eps, w, t, seeds: real_sample(h, nw, eps, w, r(t), seeds))


def _renormalised_reversed(w: torch.Tensor, eps: float) -> torch.Tensor:
    k = w.shape[1]
    total = w[:, k - 1]
    for r in range(k - 2, -1, -1):
        total = total + w[:, r]
    return w / (total + eps).unsqueeze(-1) if eps else w / total.unsqueeze(-1)


def moe_route_reversed_renorm(monkeypatch, device):
    real, real_grouped = vk.moe_route, vk.moe_route_grouped

    def route(logits, top_k, norm_topk_prob=True):
        w, ids = real(logits, top_k, False)
        return (_renormalised_reversed(w, 0.0) if norm_topk_prob else w), ids

    def grouped(logits, top_k, *, norm_topk_prob=True, routed_scaling_factor=1.0, **kw):
        w, ids = real_grouped(logits, top_k, norm_topk_prob=False, routed_scaling_factor=1.0, **kw)
        if norm_topk_prob:
            w = _renormalised_reversed(w, 1e-20)
        return w * float(routed_scaling_factor), ids

    _patch_everywhere(monkeypatch, real, route)
    _patch_everywhere(monkeypatch, real_grouped, grouped)


def moe_combine_reversed(monkeypatch, device):
    real = vk.fused_moe
    _patch_everywhere(monkeypatch, real, lambda x, w13, w2, w, ids: real(x, w13, w2, w.flip(1), ids.flip(1)))


def mla_scale_folded_into_q(monkeypatch, device):
    from vexact_models.layers.mla import MLAttention

    real_forward = MLAttention.forward

    def forward(self, x, positions, meta, kv_cache=None):
        attn, scale = self.attn, self.attn.scale
        real_attn = attn.forward

        def folded(q, k, v, meta, kv_cache=None):
            return real_attn((q.float() * scale).to(q.dtype), k, v, meta, kv_cache)

        attn.scale, attn.forward = 1.0, folded
        try:
            return real_forward(self, x, positions, meta, kv_cache)
        finally:
            attn.scale = scale
            del attn.forward

    monkeypatch.setattr(MLAttention, "forward", forward)


def _attend_sink_at(q, k_store, v_store, key_rows, last_pos, scale, window, sinks, first: bool):
    """The CPU reference's ``attention._attend`` written out again, with the sink folded in before the first key block
    (``first``: where the reference folds it) or after the last one (running max and sum rescaled to take it). With
    ``first`` it must reproduce the reference (``test_gpt_oss_sink_copy_reproduces_the_reference``), so that a failure
    under ``first=False`` is the fold's place and nothing else."""
    import math

    from vexact_kernels import portable_math as pm
    from vexact_kernels._reduce import tree_sum

    bn = _mod("attention").ATTN_BLOCK_N
    t, hq, d = q.shape
    hkv, dv = k_store.shape[1], v_store.shape[-1]
    g = hq // hkv
    qf = q.float().view(t, hkv, g, 1, d)
    sink = None if sinks is None else sinks.float().view(1, hkv, g).expand(t, hkv, g)
    m = sink if first and sink is not None else torch.full((t, hkv, g), -math.inf)
    l_sum = torch.ones(t, hkv, g) if first and sink is not None else torch.zeros(t, hkv, g)
    acc = torch.zeros(t, hkv, g, dv)
    lo = torch.zeros_like(last_pos) if window is None else (last_pos - window + 1).clamp(min=0)
    offs = torch.arange(bn)
    for blk in range(int(lo.min()) // bn, int(last_pos.max()) // bn + 1):
        pos = blk * bn + offs
        valid = (pos[None, :] <= last_pos[:, None]) & (pos[None, :] >= lo[:, None])
        rows = key_rows(0, t, torch.maximum(pos.expand(t, -1).clamp(max=last_pos[:, None]), lo[:, None]))
        kb = torch.where(valid[:, None, :, None], k_store[rows].float().permute(0, 2, 1, 3), 0.0)
        vb = torch.where(valid[:, None, :, None], v_store[rows].float().permute(0, 2, 1, 3), 0.0)
        s = tree_sum(qf * kb[:, :, None], dim=-1) * scale
        s = torch.where(valid[:, None, None, :], s, -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = pm.exp(m - m_new)
        p = pm.exp(s - m_new.unsqueeze(-1))
        l_new = l_sum * alpha + tree_sum(p, dim=-1)
        acc_new = acc * alpha.unsqueeze(-1) + tree_sum(p.unsqueeze(-1) * vb[:, :, None], dim=-2)
        active = ((blk * bn <= last_pos) & ((blk + 1) * bn > lo))[:, None, None]
        m = torch.where(active, m_new, m)
        l_sum = torch.where(active, l_new, l_sum)
        acc = torch.where(active.unsqueeze(-1), acc_new, acc)
    if sink is not None and not first:
        m_new = torch.maximum(m, sink)
        alpha = pm.exp(m - m_new)
        l_sum = l_sum * alpha + pm.exp(sink - m_new)
        acc = acc * alpha.unsqueeze(-1)
    return (acc / l_sum.unsqueeze(-1)).view(t, hq, dv)


def _patch_attend(monkeypatch, attend):
    mod, real = _mod("attention"), _mod("attention")._attend
    monkeypatch.setattr(
        mod, "_attend", lambda *a, **kw: attend(*a, **kw) if _sinks_of(a, kw) is not None else real(*a, **kw)
    )


def _sinks_of(args, kwargs):
    return kwargs.get("sinks", args[7] if len(args) > 7 else None)


def attention_sink_first_copy(monkeypatch, device):
    """Not a perturbation: the copy above with the sink where the reference folds it (the control)."""
    _patch_attend(monkeypatch, lambda *a, **kw: _attend_sink_at(*a[:6], *_window_sinks(a, kw), first=True))


def _window_sinks(args, kwargs):
    return kwargs.get("window", args[6] if len(args) > 6 else None), _sinks_of(args, kwargs)


def attention_sink_folded_last(monkeypatch, device):
    _patch_attend(monkeypatch, lambda *a, **kw: _attend_sink_at(*a[:6], *_window_sinks(a, kw), first=False))


def _sinks_head_major(real):
    def attention(q, k, *args, sinks=None, **kwargs):
        if sinks is not None:  # each head's sink read as if the heads were laid out [G, Hkv], not [Hkv, G]
            hkv = k.shape[-2]
            sinks = sinks.view(hkv, -1).t().reshape(-1)
        return real(q, k, *args, sinks=sinks, **kwargs)

    return attention


def attention_sinks_other_head_order(monkeypatch, device):
    for real in (vk.attention_packed, vk.attention_paged):
        _patch_everywhere(monkeypatch, real, _sinks_head_major(real))


def _one_more_key(real):
    def attention(*args, window=None, **kwargs):
        return real(*args, window=None if window is None else window + 1, **kwargs)

    return attention


def attention_window_one_more_key(monkeypatch, device):
    for real in (vk.attention_packed, vk.attention_paged):
        _patch_everywhere(monkeypatch, real, _one_more_key(real))


# (perturbation, checkpoint whose golden contract must fail, CPU only)
GOLDEN_CASES = [
    (matmul_reversed_k, "qwen3_moe_top8", False),
    (rms_norm_rounded_before_weight, "qwen3_hd64", False),
    (rms_norm_sequential_sum, "qwen3_moe_top8", True),
    (rotary_bf16_tables, "qwen3_hd64", False),
    (attention_other_block, "qwen3_hd64", False),
    (logprobs_sequential_sums, "qwen3_hd64", True),
    (logprobs_bf16_temperature, "qwen3_hd64", False),
    (moe_route_reversed_renorm, "qwen3_moe_top8", False),
    (moe_route_reversed_renorm, "deepseek_v3_top6", False),
    (moe_combine_reversed, "qwen3_moe_top8", False),
    (moe_combine_reversed, "qwen3_moe_top8_raw", False),
    (moe_combine_reversed, "deepseek_v3_top6", False),
    (mla_scale_folded_into_q, "deepseek_v3_top6", False),
    (attention_sinks_other_head_order, "gpt_oss", False),
    (attention_window_one_more_key, "gpt_oss", False),
]


def _case_id(case) -> str:
    return f"{case[0].__name__}-{case[1]}"


@functools.cache
def _fixture(target: str, checkpoint: str):
    return golden.load(target, checkpoint)[0]


def _golden_mismatches(target: str, device: str, checkpoint: str) -> list[str]:
    """The quick golden contract: the names of the fixture's trainer tensors that the rescoring does not reproduce."""
    ref = _fixture(target, checkpoint)
    now = golden.rescore(ref, device, checkpoint)
    return [name for name, t in now.items() if not torch.equal(t, ref[name])]


@functools.cache
def _holds_unperturbed(target: str, device: str, checkpoint: str) -> list[str]:
    return _golden_mismatches(target, device, checkpoint)


def _check_golden_fails(monkeypatch, perturb, checkpoint: str, target: str, device: str) -> None:
    broken = _holds_unperturbed(target, device, checkpoint)
    assert broken == [], (
        f"golden[{checkpoint}] on {target} does not hold unperturbed ({broken} differ), so it cannot be shown "
        f"failing; re-record it where it is wrong: {golden.record_command(target, checkpoint)}"
    )
    with monkeypatch.context() as m:
        perturb(m, device)
        broken = _golden_mismatches(target, device, checkpoint)
    assert "trainer_logprobs" in broken, f"golden[{checkpoint}] did not see {perturb.__name__}"


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=_case_id)
def test_golden_catches(monkeypatch, case, target):
    if target != "cpu":
        pytest.skip(f"the cpu fixtures' case; test_golden_catches_gpu checks the {target} fixtures")
    perturb, checkpoint, _ = case
    _check_golden_fails(monkeypatch, perturb, checkpoint, "cpu", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GOLDEN_CASES if not c[2]], ids=_case_id)
def test_golden_catches_gpu(monkeypatch, case, target, device):
    if target == "cpu":
        pytest.skip("the GPU twin checks a GPU target's fixtures: run with --target h100 / h200 / b200")
    perturb, checkpoint, _ = case
    impl = golden.attention_impl(target, checkpoint)
    if perturb is attention_other_block and impl != "triton":
        pytest.skip(f"{checkpoint} runs attention {impl!r} here, whose tiles this perturbation does not change")
    _check_golden_fails(monkeypatch, perturb, checkpoint, target, device)


def _linear_rows_violations(device: str) -> list[int]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 512, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(48, 512, generator=g).to(torch.bfloat16).to(device)
    # fp32 out, as the MoE router calls it: an fp32 order change shows in every row, not only where a bf16 cast flips
    op = lambda t: vk.linear(t, w, out_dtype=torch.float32)  # noqa: E731
    return row_invariance_violations(op, x, [[0, 3, 5], list(range(12))])


@pytest.mark.parametrize("on", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batch_invariance_catches_k_order_by_m(monkeypatch, on):
    assert _linear_rows_violations(on) == [], "batch invariance does not hold unperturbed"
    with monkeypatch.context() as m:
        matmul_k_order_by_m(m, on)
        assert _linear_rows_violations(on) != [], "batch invariance did not see a K order chosen by M"


@pytest.mark.parametrize("checkpoint", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("perturb", [moe_combine_reversed, moe_route_reversed_renorm], ids=lambda f: f.__name__)
def test_top2_checkpoints_cannot_see_the_rank_order(monkeypatch, perturb, checkpoint):
    """Why the top-8 / top-6 variants exist: with two terms the rank order changes no bit (compared with the unperturbed
    rescoring on this machine, not with the fixture)."""
    ref = _fixture("cpu", checkpoint)
    before = golden.rescore(ref, "cpu", checkpoint)
    with monkeypatch.context() as m:
        perturb(m, "cpu")
        after = golden.rescore(ref, "cpu", checkpoint)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_full_golden_catches_the_reversed_combine(monkeypatch, target):
    """The whole golden workload (engine rollouts and the trainer's rescoring, as ``test_golden_reproduces`` runs it)
    under the reversed combine: the engine's logprobs no longer reproduce either, and engine == trainer still holds
    (both drivers call the same perturbed op, which is why only a golden fixture can see it)."""
    if target != "cpu":
        pytest.skip("the quick GPU twins cover the GPU targets")
    assert _holds_unperturbed("cpu", "cpu", "qwen3_moe_top8") == [], "golden[qwen3_moe_top8] fails unperturbed"
    ref = _fixture("cpu", "qwen3_moe_top8")
    moe_combine_reversed(monkeypatch, "cpu")
    now = golden.produce("cpu", "qwen3_moe_top8")
    assert not torch.equal(now["engine_logprobs"], ref["engine_logprobs"])
    assert not torch.equal(now["trainer_logprobs"], ref["trainer_logprobs"])
    assert torch.equal(now["engine_logprobs"], now["trainer_logprobs"])


def test_gpt_oss_sink_copy_reproduces_the_reference(monkeypatch, target):
    """The control of ``attention_sink_folded_last``: the same code with the sink folded first reproduces
    golden[gpt_oss] bit for bit, so the failure under the perturbation is the fold's place."""
    if target != "cpu":
        pytest.skip("the copy patches the CPU reference's attention (_attend): a cpu-target case")
    assert _holds_unperturbed("cpu", "cpu", "gpt_oss") == []
    with monkeypatch.context() as m:
        attention_sink_first_copy(m, "cpu")
        assert _golden_mismatches("cpu", "cpu", "gpt_oss") == []


def paged_window_one_more_key(monkeypatch, device):
    """``attention_window_one_more_key`` in the paged (engine) path alone."""
    real = vk.attention_paged
    _patch_everywhere(monkeypatch, real, _one_more_key(real))


def paged_sink_folded_last(monkeypatch, device):
    """``attention_sink_folded_last`` in the paged (engine) path alone."""
    real = vk.attention_paged

    def paged(*args, **kwargs):
        with pytest.MonkeyPatch.context() as m:
            attention_sink_folded_last(m, device)
            return real(*args, **kwargs)

    _patch_everywhere(monkeypatch, real, paged)


@pytest.mark.parametrize(
    "perturb", [attention_sink_folded_last, attention_window_one_more_key], ids=lambda f: f.__name__
)
def test_gpt_oss_engine_equals_trainer_catches_a_paged_only_change(monkeypatch, perturb, target):
    """Engine == trainer on gpt_oss holds, and fails when the sink's fold or the window's boundary changes in the
    paged (chunked-prefill and decode) path alone."""
    if target != "cpu":
        pytest.skip("the sink-last fold patches the CPU reference's attention (_attend): a cpu-target case")
    from contracts.harness import logprob_mismatches
    from contracts.test_engine_trainer import run_engine, trainer_logprobs
    from vexact_engine import EngineConfig, SamplingParams
    from vexact_models import default_checkpoint, load_model

    model = load_model(default_checkpoint("gpt_oss"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 45, 12)]
    params = [SamplingParams(temperature=1.0, max_tokens=10, seed=i, ignore_eos=True) for i in range(3)]
    cfg = EngineConfig(max_num_seqs=3, max_num_batched_tokens=16, block_size=4, max_model_len=96)
    outs, _ = run_engine(model, prompts, params, cfg)
    assert logprob_mismatches(outs, trainer_logprobs(model, outs, params)) == [], "does not hold unperturbed"
    with monkeypatch.context() as m:
        perturb(m, "cpu")
        outs, _ = run_engine(model, prompts, params, cfg)
    assert logprob_mismatches(outs, trainer_logprobs(model, outs, params)) != []
