"""The batch verl's trainer hands an actor engine's ``compute_log_prob`` / ``train_batch``, built as verl builds it,
for the engine tests (``test_verl_actor_engine.py``, ``test_verl_veomni.py``); conftest.py puts this folder on the
path."""

from __future__ import annotations

import torch


def packed_batch(prompts, responses, temperature, calculate_entropy: bool = True):
    """Left-padded prompts and right-padded responses, packed (``left_right_2_no_padding``), two micro-batches of two
    sequences. ``temperature``: a float (one for the batch) or a tensor (per sample: a batch column, split into
    micro-batches with the rows, as verl's trainer sends the rollout's temperatures)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    plen, rlen, bs = max(map(len, prompts)), max(map(len, responses)), len(prompts)
    input_ids = torch.zeros(bs, plen + rlen, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(bs, rlen, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, plen - len(p) : plen] = torch.tensor(p)
        input_ids[i, plen : plen + len(r)] = torch.tensor(r)
        attention_mask[i, plen - len(p) : plen + len(r)] = 1
        response_mask[i, : len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cols = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
    cols.update(position_ids=position_ids, prompts=input_ids[:, :plen], responses=input_ids[:, plen:])
    td = left_right_2_no_padding(TensorDict(cols, batch_size=[bs]))
    if isinstance(temperature, torch.Tensor):
        td["temperature"] = temperature
    else:
        tu.assign_non_tensor(td, temperature=temperature)
    tu.assign_non_tensor(
        td,
        calculate_entropy=calculate_entropy,
        compute_loss=False,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,  # two micro-batches of two sequences
        use_fused_kernels=False,
        global_token_num=[len(p) + len(r) for p, r in zip(prompts, responses, strict=True)],
    )
    return td
