"""The trainer's logprobs (and, when asked, its top-1 tokens) of the rollouts' tokens, batched by token count."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import vexact_kernels as vk

from ..actor import Actor
from ..batch import pack
from .rollouts import Rollout


@dataclass
class Rescored:
    """The trainer's view of the rollouts: ``logprobs`` (fp32, one tensor per rollout) and, when asked for,
    ``top1`` (the trainer's argmax token at each response position, int64)."""

    logprobs: list[torch.Tensor]
    top1: list[torch.Tensor] | None = None


def _batches(rollouts: list[Rollout], max_tokens: int) -> list[list[int]]:
    out, cur, n = [], [], 0
    for i, r in enumerate(rollouts):
        size = len(r.prompt_token_ids) + len(r.token_ids)
        if cur and n + size > max_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += size
    return out + ([cur] if cur else [])


@torch.no_grad()
def _trainer_top1(actor: Actor, prompts, responses) -> list[torch.Tensor]:
    model = actor.model
    cfg = model.config
    batch = pack(prompts, responses, cfg.vocab_size, cfg.max_position_embeddings)
    batch = batch.to(next(model.parameters()).device)
    with vk.use_backend(actor.config.backend):
        hidden = model(batch.input_ids, batch.positions, batch.meta)
        top = torch.cat([model.logits(hidden[s : s + 1024]).argmax(-1) for s in range(0, len(hidden), 1024)])
    out, start = [], 0
    for plen, n in zip(batch.prompt_lens, batch.seq_lens, strict=True):
        out.append(top[start + plen - 1 : start + n - 1].cpu())
        start += n
    return out


def rescore(
    actor: Actor | torch.nn.Module,
    rollouts: list[Rollout],
    max_batch_tokens: int = 16384,
    with_top1: bool = True,
    progress: bool = True,
) -> Rescored:
    """The trainer's logprobs of every rollout's tokens (:meth:`Actor.compute_log_probs`, at each rollout's
    temperature), in batches of at most ``max_batch_tokens`` prompt + response tokens (a longer rollout gets a batch
    of its own); ``with_top1`` also records the trainer's top-1 token at each position (a second forward)."""
    from tqdm.auto import tqdm

    if not isinstance(actor, Actor):
        actor = Actor(actor)
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rollouts)
    top1: list[torch.Tensor] | None = [torch.empty(0)] * len(rollouts) if with_top1 else None
    bar = tqdm(total=len(rollouts), desc="rescoring", unit="seq", disable=not progress)
    for idx in _batches(rollouts, max_batch_tokens):
        prompts = [rollouts[i].prompt_token_ids for i in idx]
        responses = [rollouts[i].token_ids for i in idx]
        temps = [float(rollouts[i].temperature) for i in idx]
        scored = actor.compute_log_probs(prompts, responses, temps)
        tops = _trainer_top1(actor, prompts, responses) if with_top1 else None
        for j, i in enumerate(idx):
            logprobs[i] = scored.logprobs[j].float().cpu()
            if top1 is not None:
                top1[i] = tops[j]
        bar.update(len(idx))
    bar.close()
    return Rescored(logprobs, top1)
