"""The FSDP2 policy trainer: packed forward on the shared model, policy loss, AdamW step, checkpoints, weight sync.

One :meth:`Trainer.train_step` is one optimizer step over one rollout batch (each rank brings its own share of the
sequences). Losses are token means over the *global* batch (all micro-batches, all ranks), so the update does not
depend on how the batch was split (nor does the MoE router's auxiliary loss: see :class:`TrainerConfig`). Every
decision that could make ranks diverge (bad input, a NaN loss, a non-finite gradient) is agreed on by all ranks first,
so one bad rank never leaves the others hanging in a collective and never lets a partial update through.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vexact_models import record_router

from .actor import Actor, ActorConfig, LogprobOutput
from .batch import PackedBatch, check_temperatures, pack
from .losses import k3_kl, ppo_clip_loss, rollout_correction, sequence_load_balancing_loss
from .parallel import init_distributed, parallelize
from .weights import DEFAULT_BUCKET_BYTES, save_hf_checkpoint, sync_weights

log = logging.getLogger("vexact_trainer")

POLICY_LOSSES = ("ppo_clip", "reinforce")
CORRECTIONS = ("none", "tis", "mis")


@dataclass
class TrainerConfig:
    """Optimisation settings; validated at construction.

    ``policy_loss``: ``ppo_clip`` (PPO's clipped surrogate; GRPO is this with :func:`grpo_advantages`) or
    ``reinforce``. ``rollout_correction``: ``tis`` (truncated importance weights ``min(pi_old/pi_rollout, C)``) or
    ``mis`` (drop tokens whose ratio is outside ``[1/C, C]``), ``C = rollout_correction_threshold``; needs
    ``rollout_logprobs`` in the batch, and is a no-op when they equal the trainer's (the invariant backend).
    ``micro_batch_tokens``: token budget of one forward/backward (None: the whole local batch at once).

    ``router_aux_loss_coef`` (MoE models; 0 = off, the default, as RL recipes run): adds ``coef`` times the router's
    load-balancing loss (transformers' ``load_balancing_loss_func``, on the model config's ``num_experts`` and
    ``num_experts_per_tok``). transformers adds it once per forward over whatever batch that forward saw, so its value
    would depend on the micro-batch and rank split; here it is computed per *sequence* (that sequence's tokens, prompt
    and response, over all sparse layers) and averaged over every sequence of the global batch weighted by its token
    count, which no split changes (a sequence never straddles micro-batches or ranks). This balances the experts
    within each sequence (like DeepSeek-V3's sequence-wise auxiliary loss), a stricter target than a whole batch's
    balance; keep the coefficient small. ``StepMetrics.router_aux_loss`` reports the unscaled value.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    rollout_correction: str = "none"
    rollout_correction_threshold: float = 2.0
    entropy_coeff: float = 0.0
    backend: str = "invariant"
    logprob_chunk_size: int = 1024
    micro_batch_tokens: int | None = None
    router_aux_loss_coef: float = 0.0
    activation_checkpointing: bool = False
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas!r}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got eps={self.eps}, wd={self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {self.policy_loss!r}")
        if self.rollout_correction not in CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {CORRECTIONS}, got {self.rollout_correction!r}")
        if self.rollout_correction_threshold <= 1.0:
            raise ValueError(f"rollout_correction_threshold must be > 1, got {self.rollout_correction_threshold}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip ranges must be >= 0, got low={self.clip_low}, high={self.clip_high}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {self.micro_batch_tokens}")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not (isinstance(coef, (int, float)) and coef >= 0 and math.isfinite(coef)):
            raise ValueError(f"router_aux_loss_coef must be a finite number >= 0, got {coef!r}")
        ActorConfig(self.backend, self.logprob_chunk_size)  # validates both


@dataclass
class RolloutBatch:
    """This rank's share of a rollout batch: one entry per sequence.

    ``advantages``: one value per sequence (outcome rewards, GRPO) or one tensor per sequence with a value per
    response token. ``rollout_logprobs``: the engine's logprob of each response token (for rollout correction and
    the mismatch metrics). ``old_logprobs``: the trainer's logprobs at the rollout policy; None means this step is
    on-policy (the first update after the rollout), so they are taken from this step's own forward, which computes
    them bitwise as a separate scoring pass would. ``loss_masks``: 0/1 per response token (e.g. 0 on tool output);
    default all ones.
    """

    prompts: Sequence[Sequence[int]]
    responses: Sequence[Sequence[int]]
    advantages: Sequence[float] | torch.Tensor | Sequence[torch.Tensor]
    rollout_logprobs: Sequence[torch.Tensor] | None = None
    old_logprobs: Sequence[torch.Tensor] | None = None
    loss_masks: Sequence[Sequence[int] | torch.Tensor] | None = None
    temperature: float | Sequence[float] = 1.0


@dataclass
class _Seq:
    prompt: list[int]
    response: list[int]
    advantage: torch.Tensor  # [R]
    mask: torch.Tensor  # [R]
    temperature: float
    rollout: torch.Tensor | None = None  # [R]
    old: torch.Tensor | None = None  # [R]
    filler: bool = False  # a replay that keeps this rank in step with busier ones; weighs nothing


@dataclass
class StepMetrics:
    """Global (all-rank) statistics of one step. ``skipped``: why no update was applied (None when it was)."""

    step: int
    loss: float
    grad_norm: float
    tokens: int
    k3_kl: float
    mismatch_fraction: float
    max_abs_delta: float
    clip_fraction: float
    approx_kl: float
    entropy: float
    kept_fraction: float
    skipped: str | None = None
    router_aux_loss: float = 0.0  # the router's load-balancing loss (unscaled); 0 when router_aux_loss_coef is 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class Trainer:
    """FSDP2 actor + AdamW. ``model``: an fp32 vexact-models causal LM, or a checkpoint path (loaded in fp32).

    Every rank constructs one and calls the same methods in the same order (they run collectives).
    """

    def __init__(self, model: nn.Module | str | Path, config: TrainerConfig | None = None, mesh=None):
        self.config = config or TrainerConfig()
        cfg = self.config
        if isinstance(model, (str, Path)):
            from vexact_models import load_model

            model = load_model(model, dtype="float32")
        if cfg.router_aux_loss_coef and not getattr(model.config, "num_experts", 0):
            raise ValueError(
                f"router_aux_loss_coef={cfg.router_aux_loss_coef} needs an MoE model; "
                f"{type(model.config).__name__} has no experts (set router_aux_loss_coef=0)"
            )
        model.requires_grad_(True).train()
        if isinstance(model, FSDPModule):
            param = next(model.parameters())
            self.mesh = param.device_mesh if isinstance(param, DTensor) else mesh
        else:
            self.mesh = mesh or init_distributed()
            parallelize(
                model,
                self.mesh,
                param_dtype=cfg.param_dtype,
                reduce_dtype=cfg.reduce_dtype,
                activation_checkpointing=cfg.activation_checkpointing,
            )
        self.model = model
        self.device = next(model.parameters()).device
        self.actor = Actor(model, ActorConfig(cfg.backend, cfg.logprob_chunk_size))
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
        self.step = 0
        self.last_micro_batches = (0, 0)  # (this rank's micro-batches, passes run) in the last step

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    # ---- scoring
    def compute_log_probs(
        self, prompts, responses, temperature=1.0, with_entropy=False, with_router=False
    ) -> LogprobOutput:
        """Per-response-token logprobs (and entropy, MoE routing) with the bf16 weights the forward uses; see
        :class:`Actor`."""
        return self.actor.compute_log_probs(prompts, responses, temperature, with_entropy, with_router)

    # ---- input checks
    def _validate(self, batch: RolloutBatch) -> list[_Seq]:
        n = len(batch.prompts)
        if n == 0:
            raise ValueError("empty batch: no sequences to train on")
        if len(batch.responses) != n:
            raise ValueError(f"{n} prompts but {len(batch.responses)} responses")
        temps = check_temperatures(batch.temperature, n).tolist()
        per_token_adv = not isinstance(batch.advantages, torch.Tensor) and any(
            isinstance(a, torch.Tensor) and a.dim() == 1 for a in batch.advantages
        )
        advantages = batch.advantages if per_token_adv else torch.as_tensor(batch.advantages, dtype=torch.float32)
        if len(advantages) != n:
            raise ValueError(f"{len(advantages)} advantages for {n} sequences")
        for name, per_seq in (("rollout_logprobs", batch.rollout_logprobs), ("old_logprobs", batch.old_logprobs)):
            if per_seq is not None and len(per_seq) != n:
                raise ValueError(f"{len(per_seq)} {name} entries for {n} sequences")
        if batch.loss_masks is not None and len(batch.loss_masks) != n:
            raise ValueError(f"{len(batch.loss_masks)} loss masks for {n} sequences")
        if self.config.rollout_correction != "none" and batch.rollout_logprobs is None:
            raise ValueError(f"rollout_correction={self.config.rollout_correction!r} needs rollout_logprobs")

        def per_token(name: str, value, i: int, r: int) -> torch.Tensor:
            t = torch.as_tensor(value, dtype=torch.float32).detach().cpu()
            if t.shape != (r,):
                raise ValueError(f"sequence {i}: {name} has shape {tuple(t.shape)} for {r} response tokens")
            return t

        rollout_lps, old_lps = batch.rollout_logprobs, batch.old_logprobs
        seqs = []
        for i in range(n):
            p, r = batch.prompts[i], batch.responses[i]
            p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            r = r.tolist() if isinstance(r, torch.Tensor) else list(r)
            nr = len(r)
            adv = per_token("advantages", advantages[i], i, nr) if per_token_adv else advantages[i].expand(nr)
            if batch.loss_masks is None:
                mask = torch.ones(nr)
            else:
                mask = per_token("loss mask", batch.loss_masks[i], i, nr)
                if bool(((mask != 0) & (mask != 1)).any()):
                    raise ValueError(f"sequence {i}: loss mask values must be 0 or 1, got {mask.unique().tolist()}")
            seqs.append(
                _Seq(
                    p,
                    r,
                    adv,
                    mask,
                    float(temps[i]),
                    None if rollout_lps is None else per_token("rollout_logprobs", rollout_lps[i], i, nr),
                    None if old_lps is None else per_token("old_logprobs", old_lps[i], i, nr),
                )
            )
        cfg = self.model.config
        pack([s.prompt for s in seqs], [s.response for s in seqs], cfg.vocab_size, cfg.max_position_embeddings)
        return seqs

    def _agree(self, ok: bool) -> bool:
        """True iff ``ok`` on every rank (one small all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _micro_batches(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        budget = self.config.micro_batch_tokens
        groups: list[list[_Seq]] = [[]]
        used = 0
        for s in seqs:
            n = len(s.prompt) + len(s.response)
            if budget is not None and groups[-1] and used + n > budget:
                groups.append([])
                used = 0
            groups[-1].append(s)
            used += n
        # Every rank must run as many forward/backward passes as the busiest one (FSDP's gathers are collective);
        # the extra ones replay a sequence with an all-zero mask, which adds nothing to the gradient.
        count = torch.tensor([len(groups)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        filler = seqs[0]
        self.last_micro_batches = (len(groups), int(count.item()))
        replay = _Seq(filler.prompt, filler.response, filler.advantage, torch.zeros_like(filler.mask), 1.0, filler=True)
        while len(groups) < int(count.item()):
            groups.append([replay])
        return groups

    # ---- one step
    def train_step(self, batch: RolloutBatch) -> StepMetrics:
        """One optimizer step on ``batch`` (this rank's share). Bad input raises ``ValueError`` on every rank; a
        non-finite loss or gradient skips the step on every rank (``metrics.skipped`` says why) and changes nothing.
        """
        error = None
        try:
            seqs = self._validate(batch)
        except ValueError as e:
            error = e
        if not self._agree(error is None):
            raise error or ValueError(f"rank {self.rank}: another rank's batch was rejected; see its error")
        dev = self.device
        n_local = sum(float(s.mask.sum()) for s in seqs)
        n_routed_local = sum(len(s.prompt) + len(s.response) for s in seqs)  # every token passes the router
        n_global_t = torch.tensor([n_local, n_routed_local], dtype=torch.float64, device=dev)
        dist.all_reduce(n_global_t)
        n_global, n_routed = n_global_t.tolist()
        if n_global == 0:
            raise ValueError("no response tokens to train on: every response is empty or fully masked")
        scale = self.world_size / n_global  # FSDP averages gradients over ranks; undo it for a global token mean
        aux_scale = self.world_size / n_routed
        # sums over this rank's tokens: loss, k3, mismatched, clipped, approx_kl, entropy, kept, compared, router aux
        sums = torch.zeros(9, dtype=torch.float64, device=dev)
        max_delta = torch.zeros(1, dtype=torch.float64, device=dev)
        self.optimizer.zero_grad(set_to_none=True)
        skipped = None
        for group in self._micro_batches(seqs):
            loss, part, delta = self._forward_backward_terms(group, scale, aux_scale)
            if not self._agree(bool(torch.isfinite(loss))):
                skipped = f"non-finite loss at step {self.step} (on at least one rank)"
                break
            loss.backward()
            sums += part
            max_delta = torch.maximum(max_delta, delta)
        grad_norm = float("nan")
        if skipped is None:
            grad_norm = self._clip_grad_norm()
            if not math.isfinite(grad_norm):
                skipped = f"non-finite gradient norm {grad_norm} at step {self.step}"
        dist.all_reduce(sums)
        dist.all_reduce(max_delta, op=dist.ReduceOp.MAX)
        if skipped is None:
            self.optimizer.step()
        else:
            log.warning("step skipped: %s; no update applied", skipped)
            for module in self.model.modules():  # a forward without its backward: drop any gathered parameters
                if isinstance(module, FSDPModule):
                    module.reshard()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        s = sums.tolist()
        compared = s[7]
        return StepMetrics(
            step=self.step,
            loss=s[0] / n_global,
            grad_norm=grad_norm,
            tokens=int(n_global),
            k3_kl=s[1] / compared if compared else 0.0,
            mismatch_fraction=s[2] / compared if compared else 0.0,
            max_abs_delta=float(max_delta.item()),
            clip_fraction=s[3] / n_global,
            approx_kl=s[4] / n_global,
            entropy=s[5] / n_global,
            kept_fraction=s[6] / n_global,
            skipped=skipped,
            router_aux_loss=s[8] / n_routed,
        )

    def _forward_backward_terms(self, group: list[_Seq], scale: float, aux_scale: float):
        """The scaled loss of one micro-batch (to backward) and its statistics."""
        cfg = self.config
        mcfg = self.model.config
        batch: PackedBatch = pack(
            [s.prompt for s in group], [s.response for s in group], mcfg.vocab_size, mcfg.max_position_embeddings
        )
        rows = batch.input_ids.numel()
        adv, mask, old, rollout = (torch.zeros(rows) for _ in range(4))
        temps = torch.empty(rows, dtype=torch.float32)
        start = 0
        for s, plen, n in zip(group, batch.prompt_lens, batch.seq_lens, strict=True):
            sl = slice(start + plen - 1, start + n - 1)  # the row before each response token predicts it
            adv[sl], mask[sl] = s.advantage, s.mask
            if s.old is not None:
                old[sl] = s.old
            if s.rollout is not None:
                rollout[sl] = s.rollout
            temps[start : start + n] = s.temperature
            start += n
        dev = self.device
        adv, mask, old, rollout, temps = (t.to(dev) for t in (adv, mask, old, rollout, temps))
        coef = cfg.router_aux_loss_coef
        with record_router() if coef else contextlib.nullcontext() as router:
            lp, ent = self.actor.forward_packed(batch, temps, with_entropy=True)
        aux_sum = torch.zeros((), device=dev)  # sum over sequences of (tokens * the sequence's balancing loss)
        if coef:
            if not router:
                raise ValueError(f"router_aux_loss_coef={coef}: the model recorded no router output (no sparse layer)")
            per_seq = sequence_load_balancing_loss(router, batch.seq_lens, mcfg.num_experts, mcfg.num_experts_per_tok)
            tokens = [0.0 if s.filler else float(n) for s, n in zip(group, batch.seq_lens, strict=True)]
            aux_sum = (per_seq * torch.tensor(tokens, device=dev)).sum()
        has_old = group[0].old is not None
        old = old if has_old else lp.detach()
        has_rollout = group[0].rollout is not None
        weights, kept = None, mask
        if has_rollout and cfg.rollout_correction != "none":
            weights, kept = rollout_correction(
                old, rollout, mask, cfg.rollout_correction, cfg.rollout_correction_threshold
            )
        if cfg.policy_loss == "ppo_clip":
            out = ppo_clip_loss(lp, old, adv, kept, cfg.clip_low, cfg.clip_high, weights)
            n_kept = kept.sum().clamp(min=1)
            loss_sum, clipped, approx_kl = out.loss * n_kept, out.clip_fraction * n_kept, out.approx_kl * n_kept
        else:
            w = kept if weights is None else kept * weights
            loss_sum = -(adv * lp * w).sum()
            clipped = torch.zeros((), device=dev)
            approx_kl = (0.5 * (lp.detach() - old) ** 2 * kept).sum()
        ent_sum = (ent * mask).sum()
        loss = loss_sum * scale
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * ent_sum * scale
        if coef:
            loss = loss + coef * aux_sum * aux_scale
        with torch.no_grad():
            sel = mask.bool()
            if has_rollout:
                log_r = old[sel].double() - rollout[sel].double()
                k3 = k3_kl(log_r).sum()
                mism = (old[sel] != rollout[sel]).sum().double()
                delta = log_r.abs().amax(dim=0, keepdim=True) if log_r.numel() else log_r.new_zeros(1)
                compared = sel.sum().double()
            else:
                k3 = mism = compared = torch.zeros((), dtype=torch.float64, device=dev)
                delta = torch.zeros(1, dtype=torch.float64, device=dev)
            part = torch.stack(
                [
                    loss_sum.detach().double(),
                    k3.double(),
                    mism,
                    clipped.double(),
                    approx_kl.double(),
                    ent_sum.detach().double(),
                    kept.sum().double(),
                    compared,
                    aux_sum.detach().double(),
                ]
            )
        return loss, part, delta

    def _clip_grad_norm(self) -> float:
        """Global gradient norm (all shards, all ranks), clipped to ``max_grad_norm`` if set."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.config.max_grad_norm is not None and torch.isfinite(total):
            torch.nn.utils.clip_grads_with_norm_(params, self.config.max_grad_norm, total, foreach=True)
        return float(total)

    # ---- weights and checkpoints
    def sync_weights(self, engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[str] | None:
        """Export the bf16 weights to ``engine.update_weights`` (rank 0's engine; pass None on other ranks)."""
        return sync_weights(self.model, engine, bucket_bytes)

    def save_hf_checkpoint(self, path: str | Path, max_shard_bytes: int | None = None) -> Path | None:
        """HF-format bf16 safetensors of the current weights (what the engine would load); rank 0 writes."""
        return save_hf_checkpoint(self.model, path, max_shard_bytes=max_shard_bytes)

    def save_checkpoint(self, path: str | Path) -> None:
        """Sharded model + optimizer state + step with torch.distributed.checkpoint (each rank writes its shards)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd, "trainer": {"step": torch.tensor(self.step)}}
        dcp.save(state, checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (any world size: DCP reshards on load)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not Path(path).is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd, "trainer": {"step": torch.tensor(0)}}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = int(state["trainer"]["step"])
