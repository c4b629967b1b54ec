"""verl's ``old_log_prob`` outside the model's forward: what the vexact actor and its TIM summary add per sequence.

Counted, not timed: the aten ops that run (a ``TorchDispatchMode``) for a batch of ``n`` and of ``2 n`` sequences
of the same lengths. An op count that grows with the batch is a per-sequence Python loop or a per-sequence copy.

- verl's ``calculate_debug_metrics`` with the TIM summary wrapped around it (``vexact_verl.tim.install``, run by verl on
  the driver inside its ``old_log_prob`` timer): no op per sequence.
- the actor engine's ``infer_batch`` for ``compute_log_prob`` and the driver's ``no_padding_2_padding`` of its output,
  outside the model's forward and log-probs: the vexact engine adds no op per sequence beyond what verl's own
  ``FSDPEngineWithLMHead`` runs on the same batch (verl's micro-batch split, ``postprocess_batch_func`` and
  ``no_padding_2_padding`` unbind every sequence, in both engines), and hands back verl's layout: jagged, contiguous,
  fp32, each tensor owning exactly its values.

``benchmarks/old_log_prob.py`` times the same path phase by phase at a realistic size.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl_batches import packed_batch  # noqa: E402

from vexact_verl.engine_builder import build_actor_engine  # noqa: E402


class OpCount(TorchDispatchMode):
    """Counts aten ops while ``counting`` is set."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += self.counting
        return func(*args, **(kwargs or {}))

    @contextmanager
    def paused(self):
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before


def test_tim_summary_runs_no_op_per_sequence():
    protocol = pytest.importorskip("verl.protocol")
    from verl.utils.debug import metrics as verl_metrics

    from vexact_verl.tim import install

    install()

    def ops(rows: int) -> int:
        g = torch.Generator().manual_seed(0)
        lp = -torch.rand(rows, 64, generator=g)
        mask = (torch.arange(64) < torch.randint(1, 65, (rows, 1), generator=g)).long()
        batch = protocol.DataProto.from_dict(
            {"rollout_log_probs": lp, "old_log_probs": lp + 1e-3, "response_mask": mask, "responses": mask}
        )
        with OpCount() as count:
            out = verl_metrics.calculate_debug_metrics(batch)
        assert "tim/k3_kl" in out
        return count.n

    assert ops(8) == ops(64)


PROMPTS = [[257, 72, 101], [257, 49, 43, 49, 61, 50], [257, 10], [257, 120, 61]]
RESPONSES = [[50, 51, 52, 256], [33], [97, 98, 99, 100, 101], [55, 56]]


def _path_ops(engine, copies: int) -> tuple[int, dict, torch.Tensor]:
    """aten ops of ``infer_batch`` (one micro-batch) and the driver's ``no_padding_2_padding`` of its log-probs and
    entropy for ``copies`` x the four test sequences, the model's forward and log-probs not counted; the engine's
    output and the padded log-probs."""
    from verl.workers.utils.padding import no_padding_2_padding

    data = packed_batch(PROMPTS * copies, RESPONSES * copies, 1.0)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=len(PROMPTS) * copies)
    count = OpCount()
    module = engine.module
    # FSDP registers `logprobs` as a forward method on the instance: put back whatever the instance held
    held = {name: module.__dict__.get(name) for name in ("forward", "logprobs") if hasattr(module, name)}
    for name in held:
        method = getattr(module, name)

        def paused(*args, _method=method, **kwargs):
            with count.paused():
                return _method(*args, **kwargs)

        setattr(module, name, paused)
    try:
        with engine.eval_mode(), count:
            out = engine.infer_batch(data, loss_function=None)["model_output"]
            padded = [no_padding_2_padding(out[k], data) for k in ("log_probs", "entropy")]
    finally:
        for name, own in held.items():
            if own is None:
                del module.__dict__[name]
            else:
                module.__dict__[name] = own
    return count.n, out, padded[0]


def _verl_layout_only(micro_batch, loss_function, forward_only):
    """The least a ``forward_step`` hands verl: zeros in verl's layout (the floor of verl's own per-sequence work)."""
    ids = micro_batch["input_ids"]
    zeros = torch.nested.nested_tensor_from_jagged(torch.zeros(ids.values().shape), ids.offsets())
    return torch.tensor(1.0), {"model_output": {"log_probs": zeros, "entropy": zeros}, "loss": 1.0, "metrics": {}}


def test_vexact_engine_adds_no_op_per_sequence_beyond_verls_engine(verl_device):
    if verl_device != "cpu":
        pytest.skip("counts the CPU path; the cuda variant runs the same code")
    # the actor engine verl builds for strategy=vexact and verl's own FSDP2 engine on the same checkpoint, as verl's
    # actor (which scores old_log_prob)
    vexact, fsdp = build_actor_engine("vexact"), build_actor_engine("fsdp2")
    (v1, out, lp1), (v2, _, lp2) = _path_ops(vexact, 1), _path_ops(vexact, 3)
    (f1, _, _), (f2, _, _) = _path_ops(fsdp, 1), _path_ops(fsdp, 3)
    vexact.forward_step = _verl_layout_only
    (z1, _, _), (z2, _, _) = _path_ops(vexact, 1), _path_ops(vexact, 3)
    per_sequence = {"vexact": (v2 - v1) / 8, "fsdp2": (f2 - f1) / 8, "verl_only": (z2 - z1) / 8}
    # verl's own work per sequence (micro-batch split, postprocess_batch_func, no_padding_2_padding), nothing of ours:
    # one op per sequence added in forward_step (a copy of each row) fails this
    assert per_sequence["vexact"] <= per_sequence["verl_only"] <= per_sequence["fsdp2"], per_sequence
    assert torch.equal(lp2[: len(PROMPTS)], lp1)  # the larger batch scores the same sequences bit for bit
    for k in ("log_probs", "entropy"):
        t = out[k]
        assert t.is_nested and t.layout == torch.jagged and t.is_contiguous(), k
        # fp32, as verl's fused log-prob kernel hands them on GPU (its CPU autocast gives bf16 here)
        assert t.values().dtype == torch.float32, (k, t.values().dtype)
        assert t.values().untyped_storage().nbytes() == t.values().numel() * 4, k  # no view of a larger buffer
