"""The actor: scores sequences with the shared model definition on a packed batch.

Parallelism is applied from outside (FSDP2's ``fully_shard`` on the model the actor is given); the actor only
decides the layout (packed) and the kernel backend, so the API stays the same when the model is sharded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import vexact_kernels as vk
from vexact_models import record_router

from .batch import PackedBatch, check_temperatures, pack


@dataclass
class ActorConfig:
    backend: str = "invariant"
    logprob_chunk_size: int = 1024  # tokens per logits chunk; never changes a value

    def __post_init__(self) -> None:
        vk.check_backend(self.backend, "backend")  # a name, or "fast:<op>,..." for per-op-family fast kernels
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")


@dataclass
class LogprobOutput:
    """Per sequence: logprob (and entropy) of each response token, fp32.

    ``router`` (MoE models, when asked for): per sequence, the experts each token was routed to, ``[sparse layers,
    prompt + response tokens, k]`` int64, best first; row ``j`` is the routing of the token at position ``j`` (so the
    response's routing starts at row ``len(prompt)``). Dense layers have no row.
    """

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None
    router: list[torch.Tensor] | None = None


class Actor:
    def __init__(self, model: torch.nn.Module, config: ActorConfig | None = None):
        self.model = model
        self.config = config or ActorConfig()

    def forward_packed(
        self, batch: PackedBatch, temperature: float | torch.Tensor = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob of every position's next token over the whole packed batch: ``([T], [T] or None)``.

        ``temperature``: a scalar, or one value per token ``[T]``; each finite and > 0 (ValueError naming the first
        that is not, and its token index).
        """
        check_temperatures(temperature, len(batch.input_ids), "tokens")
        dev = next(self.model.parameters()).device
        batch = batch.to(dev)
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(dev)
        with vk.use_backend(self.config.backend):
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
            return self.model.logprobs(hidden, batch.targets, temperature, self.config.logprob_chunk_size, with_entropy)

    @torch.no_grad()
    def compute_log_probs(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        temperature: float | list[float] = 1.0,
        with_entropy: bool = False,
        with_router: bool = False,
    ) -> LogprobOutput:
        """Logprobs of each response token given its prompt and the response tokens before it.

        ``temperature``: one for all sequences or one per sequence (a list or a 1-D tensor), each finite and > 0 (a
        ValueError names the first that is not, and its index); logits are divided by it in fp32, as the
        engine's sampler does. ``with_router``: also return each token's chosen experts per sparse layer
        (:attr:`LogprobOutput.router`; MoE models only). Recording changes no logprob.
        """
        temps = check_temperatures(temperature, len(prompts))
        cfg = self.model.config
        if with_router and not getattr(cfg, "num_experts", 0):
            raise ValueError(f"with_router=True needs an MoE model; {type(cfg).__name__} has no experts")
        batch = pack(prompts, responses, cfg.vocab_size, cfg.max_position_embeddings)
        per_token = torch.repeat_interleave(temps, torch.tensor(batch.seq_lens), output_size=len(batch.input_ids))
        with record_router() if with_router else contextlib.nullcontext() as recorded:
            lp, ent = self.forward_packed(batch, per_token, with_entropy)
        if with_router and not recorded:
            raise ValueError("with_router=True: the model has no sparse layer (every layer is dense)")
        ids = torch.stack([r.topk_ids for r in recorded]) if with_router else None  # [sparse layers, T, k]
        out_lp, out_ent, out_router = [], [], []
        start = 0
        for plen, n in zip(batch.prompt_lens, batch.seq_lens, strict=True):
            # the token at position j (j >= plen) is predicted by row j - 1
            out_lp.append(lp[start + plen - 1 : start + n - 1].clone())
            if ent is not None:
                out_ent.append(ent[start + plen - 1 : start + n - 1].clone())
            if ids is not None:
                out_router.append(ids[:, start : start + n].clone())
            start += n
        return LogprobOutput(out_lp, out_ent if with_entropy else None, out_router if with_router else None)
