"""verl's stock VeOmni engine on the tiny gpt-oss: the verify pair's ``vllm`` arm actor for ``PAIR=gptoss-1k``.

examples/verify/run_pair.sh runs that arm's actor as verl 0.9.1's own ``VeOmniEngineWithLMHead``
(``model_engine=veomni``) on one GPU with ``moe_implementation=eager`` (VeOmni 0.1.12 has no Triton kernel for
gpt-oss's experts), verl's ``mixed_precision=true`` (one GPU: no FSDP, so fp32 weights under verl's bf16 autocast) and
FA4 attention; eager attention (transformers' GptOss has no SDPA path for the sinks) only with ``ACTOR_ATTN=eager``,
since it mixes a packed row's sequences (the last test), and run_pair.sh refuses the arm otherwise. These tests build
that engine as verl's worker builds it, with bf16 weights (``mixed_precision=False``, the MoE arm's setting for
fused_triton) and fp32 weights, and run verl's ``infer_batch`` and ``train_batch`` through VeOmni's gpt-oss model.

CPU stand-ins, as in ``test_verl_actor_engine.py`` (a CPU platform on a gloo world-size-1 group), plus two for this
engine: verl registers it for ``cuda`` and ``npu`` only, so it is built by its class; and VeOmni at world size 1
applies no FSDP and accepts only an accelerator ``init_device`` (``build_parallelize_model``: "Only FSDP training
supports `init_device=meta`"), which it reads for nothing else there, so the model is loaded on the CPU
(``build_foundation_model``, ``init_device=cpu``) and that check is told ``cuda``. The ``cuda`` variants (marked
``gpu``) run verl's CUDA platform with ``init_device=cuda``, as run_pair.sh does. Needs veomni
(``pip install --no-deps -r requirements/veomni.txt``); skipped, visibly, without it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
if importlib.util.find_spec("veomni") is None:
    pytest.skip("veomni is not installed: pip install --no-deps -r requirements/veomni.txt", allow_module_level=True)

from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.workers.config import HFModelConfig, VeOmniEngineConfig, VeOmniOptimizerConfig  # noqa: E402
from verl.workers.engine.veomni import transformer_impl  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402
from verl_batches import packed_batch  # noqa: E402

from vexact_models import default_checkpoint  # noqa: E402

PROMPTS = [[257, 72, 101], [257, 49, 43, 49, 61, 50], [257, 10], [257, 120, 61]]
RESPONSES = [[50, 51, 52, 256], [33], [97, 98, 99, 100, 101], [55, 56]]


@pytest.fixture
def device(verl_device, monkeypatch):
    if verl_device == "cpu":
        build = transformer_impl.build_parallelize_model

        def build_parallelize_model(module, **kw):
            return build(module, **{**kw, "init_device": "cuda"})  # read only by the world-size-1 check

        monkeypatch.setattr(transformer_impl, "build_parallelize_model", build_parallelize_model)
    return verl_device


def stock_engine(device: str, *, mixed_precision: bool, lr: float = 1e-2):
    """verl's ``VeOmniEngineWithLMHead`` for the tiny gpt-oss with the vllm arm's settings, ``initialize()``d."""
    model_config = HFModelConfig(path=str(default_checkpoint("gpt_oss")), enable_gradient_checkpointing=True)
    model_config.model_type = "language_model"  # what verl's TrainingWorker sets before EngineRegistry.new
    engine_config = VeOmniEngineConfig(
        moe_implementation="eager",
        attn_implementation="eager",
        init_device=device,
        mixed_precision=mixed_precision,
        use_torch_compile=False,  # verl's compiled entropy helper: inductor needs a C++ toolchain on CPU
    )
    engine_config.use_remove_padding = model_config.use_remove_padding  # as TrainingWorker copies it
    engine = transformer_impl.VeOmniEngineWithLMHead(
        model_config, engine_config, VeOmniOptimizerConfig(lr=lr, total_training_steps=10), CheckpointConfig()
    )
    engine.initialize()
    return engine


def log_probs(engine) -> torch.Tensor:
    data = packed_batch(PROMPTS, RESPONSES, 1.0)
    with engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(out["model_output"]["log_probs"], data).cpu()


def _sum_loss(model_output, data, dp_group=None):
    lp = model_output["log_probs"]
    keep = torch.ones_like(lp.values(), dtype=torch.bool)
    keep[lp.offsets()[1:] - 1] = False  # each sequence's last row is scored against the next sequence
    return -lp.values()[keep].sum(), {}


def train_step(engine) -> tuple[dict, dict[str, torch.Tensor]]:
    """One ``train_batch``: its metrics and the weights before it."""
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with engine.train_mode():
        out = engine.train_batch(packed_batch(PROMPTS, RESPONSES, 1.0), _sum_loss)
    return out["metrics"], before


@pytest.mark.parametrize("mixed_precision", [True, False])
def test_stock_veomni_engine_scores_and_trains_gpt_oss_with_eager_moe_and_attention(device, mixed_precision):
    engine = stock_engine(device, mixed_precision=mixed_precision)
    module = engine.module
    assert type(module).__module__.startswith("veomni.models.transformers.gpt_oss")  # VeOmni's gpt-oss, not ours
    assert module.config._attn_implementation == "eager"
    assert {p.dtype for p in module.parameters()} == {torch.float32 if mixed_precision else torch.bfloat16}
    lp = log_probs(engine)
    assert lp.shape == (len(PROMPTS), max(map(len, RESPONSES)))
    assert all(torch.isfinite(lp[i, : len(r)]).all() and (lp[i, : len(r)] < 0).all() for i, r in enumerate(RESPONSES))
    metrics, before = train_step(engine)
    assert 0 < metrics["grad_norm"] < float("inf")
    moved = {n for n, p in module.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved == set(before), sorted(set(before) - moved)  # every tensor, sinks and experts included
    assert not torch.equal(log_probs(engine), lp)


def test_bf16_weights_drop_most_adamw_steps_at_the_pairs_learning_rate(device):
    """run_pair.sh's LR (3e-6) on one GPU: AdamW moves each element by about the learning rate, and on bf16 weights
    (``mixed_precision=False``) a step below half a unit in the last place rounds away (bf16 keeps 8 significant bits,
    so an element moves only where |w| < ~1e-3). With fp32 weights (``mixed_precision=True``) every element moves:
    why run_pair.sh keeps verl's mixed precision for the eager MoE."""
    fractions = {}
    for mixed_precision in (False, True):
        engine = stock_engine(device, mixed_precision=mixed_precision, lr=3e-6)
        _, before = train_step(engine)
        params = dict(engine.module.named_parameters())
        moved = sum((before[n] != p.detach()).sum().item() for n, p in params.items())
        fractions[mixed_precision] = moved / sum(t.numel() for t in before.values())
    assert fractions[False] < 0.05 and fractions[True] == 1.0, fractions


def test_eager_attention_on_verls_packed_row_attends_across_sequences(device):
    """verl packs each micro-batch into one row (``use_remove_padding``); FlashAttention splits it by
    ``cu_seqlens``, eager attention only through a block-causal mask built from ``position_ids``. transformers 5.9's
    ``GptOssModel.forward`` builds its masks without ``position_ids`` (``mask_kwargs`` in modeling_gpt_oss.py;
    VeOmni's generated copy keeps it; huggingface/transformers#39997), so the row gets one causal mask: the first
    sequence of each micro-batch (0 and 2, micro-batches of two) scores as it does alone, the second also attends to
    the first. This test fails once the mask takes ``position_ids``; then the eager arm's log-probs are each
    sequence's own."""
    engine = stock_engine(device, mixed_precision=True)  # fp32 weights
    engine._autocast_dtype = torch.float32  # verl's forward_step then skips its bf16 autocast: a tight tolerance
    packed = log_probs(engine)
    module = engine.module.eval()
    gap = []
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            ids = torch.tensor([p + r], device=device)
            logits = module(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None]).logits
            alone = torch.log_softmax(logits[0, len(p) - 1 : -1].float(), -1)
            alone = alone.gather(-1, torch.tensor(r, device=device)[:, None])[:, 0].cpu()
            gap.append((packed[i, : len(r)].float() - alone).abs().max().item())
    assert gap[0] < 1e-4 and gap[2] < 1e-4, gap
    assert gap[1] > 1e-2 and gap[3] > 1e-2, gap
