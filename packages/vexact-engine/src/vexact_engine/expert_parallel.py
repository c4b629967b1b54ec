"""Expert parallelism: the routed experts of every sparse MoE layer sharded over the ranks of a process group, the
attention data-parallel (each rank its own requests, scheduler and KV cache); never tensor parallelism.

Every rank builds an :class:`ExpertParallelLLM` from the same model (SPMD, e.g. under ``torchrun``) and gives it its
own requests. Rank ``r`` of ``W`` keeps routed experts ``[r * E / W, (r + 1) * E / W)`` of every sparse layer
(:func:`expert_shard`); the router, the shared experts, attention, dense layers, embedding and head are on every
rank. :func:`parallelize_experts` puts an :class:`ExpertParallelExperts` in place of each sparse block's ``experts``
module: the model code knows nothing of it. A sparse layer on rank ``r``, for its ``T_r`` tokens of the step:

1. routes them as on one device (the block's router and top-k): weights and global expert ids ``[T_r, k]``;
2. dispatch: the ranks all-gather the tokens' hidden rows and ids, padded to the step's ``C = max_r T_r`` rows
   (fixed-size buffers: one size a step, agreed once before the model runs, so no layer waits on the host);
3. each rank runs its experts on the pairs routed to them (``vk.moe_expert_outputs``: the grouped GEMM kernel of
   ``fused_moe``, every pair row reduced alone) into fp32 rows, zeros for the other pairs;
4. return: an all-to-all sends each block of ``C`` tokens' rows back to those tokens' home rank;
5. combine on the home rank: each pair's fp32 row taken from the rank that holds its expert, and ``vk.moe_combine``
   adds them in the token's own top-k order, cast once; the shared experts are added after, where the model adds
   them (``DeepseekMoeBlock``).

Why this is bitwise equal to one device (and so to the trainer): a pair's expert row is reduced alone, over K in an
order fixed by K, whichever rank computes it and whichever rows share its call (design rule 2); rows travel as raw
bytes; the combine reads them in top-k rank order, never in the order they arrive (rule 5). The contract tests
compare tokens and logprobs with ``torch.equal`` against one device and the trainer, eager and padded, and see the
check fail when the combine takes the rows in arrival order, when a padded step's pad mark covers a real row, and
(a collective mismatch) when a rank pads to the size of its own rows.

Steps: every rank calls :meth:`ExpertParallelLLM.step` together (``generate`` does, until no rank has unfinished
requests). A rank with nothing to run joins every sparse layer's exchange with zero rows (pad rows only in a padded
step). Each rank's requests and outputs are its own; requests are not moved between ranks. With ``driven=True`` (what a
server uses, as it uses ``PipelineLLM``), rank 0 alone takes requests, aborts, sleep/wake and weight updates through the
one-device API: it places each new request on the rank with the fewest unfinished ones, with the seed a one-device
engine would give it, and sends each step's new requests to every rank, which steps; the finished requests come back to
rank 0. The other ranks call :meth:`~ExpertParallelLLM.serve`.

Padded decode steps (CUDA graphs): a step's shape is agreed before the model runs, in the one all-reduce that agrees on
``C`` (:meth:`_Exchange.begin_step`). When no rank has prompt tokens (every row a one-token row, as for a one-device
padded step), every rank pads its decode rows to ``S``, the smallest of the engine's padded decode sizes
(``EngineConfig.cuda_graph_batch_sizes``, the one-device defaults) that holds the largest rank's rows, and ``C = S``; a
rank with nothing to run pads a step of pad rows only. Each rank then runs the one-device padded step
(``cuda_graphs.py``: static buffers, pad rows that write no KV and are never sampled), replayed as the CUDA graph of
size ``S`` on CUDA, the exchange's NCCL collectives captured inside it: every rank replays graphs of one size, so their
collectives match. Pad rows are marked on the device (rows from ``_Exchange.live`` on: each rank's real row count,
written before the replay) and go to no expert, and their combine reads no router output. Every kernel is row-invariant,
so pad rows change no real row's bits. A step in which any rank has prompt tokens runs eagerly on every rank (``C`` its
largest token count). The graphs are captured per rank at start-up and after every ``wake_up`` (lazily by default, as
for one device: every rank captures a size at the same step, since they agree on it), and ``update_weights`` copies into
the captured weights. A capture that fails on one rank drops every rank's graphs (the steps then run padded and eagerly
on every rank, with a replay's collectives). ``enforce_eager=True`` turns padding off; on CPU, as for one device, steps
run eagerly unless ``cuda_graph_batch_sizes`` is given, and then the padded steps run eagerly from the same static
buffers and the same agreement (how the contract tests exercise them over gloo). Steps with prompt tokens have no graphs
here (``cuda_graph_token_sizes`` is ignored), mixed steps run as one launch (``split_mixed_steps`` is off: every rank
runs the model once a step) and the draw runs eagerly after the padded step.

Cost: the dispatch all-gathers every token to every rank and the return moves ``C * k`` fp32 rows per rank pair, most of
them zeros; an all-to-all of the routed pairs alone moves less and is the next step for large ``W``. Scope: eager steps
and padded decode steps (CUDA graphs on CUDA); ``sleep``/``wake_up`` per rank; ``update_weights`` with HF names on every
rank, each keeping its own experts (``driven``: the driver cuts each rank's part, the shared weights and that rank's
experts, and sends each rank its own part only). Bucketed and broadcast weight sync are refused for now.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import vexact_kernels as vk
from vexact_models import SparseMoeBlock

from .ablation import MismatchInjection
from .block_manager import BlockManager
from .config import EngineConfig
from .llm import LLM
from .model_runner import ModelRunner
from .pipeline import _answer, _apply_sleep_wake, _engine_settings, _host_model, _require_group, _StageError
from .scheduler import ScheduledSeq

log = logging.getLogger("vexact_engine")


def expert_shard(num_experts: int, ep_size: int, rank: int) -> range:
    """The routed experts rank ``rank`` of ``ep_size`` holds: ``E / ep_size`` consecutive ids."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"expert_parallel_size must be a positive integer, got {ep_size!r}")
    if num_experts % ep_size:
        raise ValueError(
            f"expert_parallel_size={ep_size} does not divide the {num_experts} routed experts: use a divisor of "
            f"{num_experts}"
        )
    if not 0 <= rank < ep_size:
        raise ValueError(f"rank {rank} is outside [0, expert_parallel_size={ep_size})")
    per = num_experts // ep_size
    return range(rank * per, (rank + 1) * per)


def routed_experts(model: nn.Module) -> int:
    """The number of routed experts of every sparse MoE layer of ``model``; ``ValueError`` for a model without."""
    counts = {m.experts.gate_up_proj.shape[0] for m in model.modules() if isinstance(m, SparseMoeBlock)}
    if not counts:
        raise ValueError(f"{type(model).__name__} has no sparse MoE layer: expert parallelism needs routed experts")
    if len(counts) > 1:
        raise ValueError(f"sparse layers with different expert counts {sorted(counts)}: not supported")
    return counts.pop()


class _Exchange:
    """The collectives of one replica's sparse layers, and the step's shape they all use: ``rows`` (``C``) and
    whether the step runs padded (every rank's rows are ``C``, a captured graph's shape; rows from ``live`` on are
    pad rows)."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # NCCL moves device tensors; gloo moves host tensors
        self.comm = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.rows = 0
        self.padded = False
        # a padded step's real row count, read on the device (a graph replays it): written before each padded step
        self.live = torch.zeros(1, dtype=torch.int64, device=device)

    def begin_step(self, num_tokens: int, decode_rows: int | None = None, sizes: list[int] = ()) -> int | None:
        """Agree on the step's shape, one all-reduce: ``C``, the largest token count of any rank this step (0 for a
        rank with no work), and the padded size every rank runs at, returned (None: every rank runs eagerly).

        ``decode_rows``: this rank's rows when each is a one-token row (0 for a rank with no work), None when it has
        prompt tokens; ``sizes``: the padded decode sizes, the same on every rank. When no rank has prompt tokens
        and the largest rank's rows fit a size, every rank pads to the smallest such size ``S`` and ``C = S``."""
        eager = decode_rows is None
        n = torch.tensor([num_tokens, int(eager), 0 if eager else decode_rows], dtype=torch.int64, device=self.comm)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        tokens, any_eager, rows = n.tolist()
        size = None if any_eager or not rows else next((s for s in sizes if s >= rows), None)
        self.rows = tokens if size is None else size
        self.padded = size is not None
        return size

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        n = torch.tensor([int(flag)], dtype=torch.int64, device=self.comm)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return bool(n.item())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[C, ...]`` on each rank -> ``[W * C, ...]`` in rank order; floats travel as raw bytes (exact)."""
        src = t.contiguous().to(self.comm)
        wire = src.view(torch.uint8) if src.is_floating_point() else src
        out = torch.empty((self.world * wire.shape[0], *wire.shape[1:]), dtype=wire.dtype, device=self.comm)
        dist.all_gather_into_tensor(out, wire, group=self.group)  # torch 2.11 has no all_gather_single
        return out.view(t.dtype).to(t.device)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Block ``s`` of ``t`` (``W`` equal blocks along dim 0) to rank ``s``; returns the blocks received, block
        ``s`` from rank ``s``."""
        src = t.contiguous().to(self.comm)
        wire = src.view(torch.uint8) if src.is_floating_point() else src
        out = torch.empty_like(wire)
        dist.all_to_all_single(out, wire, group=self.group)
        return out.view(t.dtype).to(t.device)


def _combine_home(back: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, per_rank: int, dtype) -> torch.Tensor:
    """The combine on the tokens' home rank: pair ``(t, r)``'s fp32 row taken from the rank holding expert
    ``ids[t, r]`` (``back [W, C, k, H]``: block ``s`` from rank ``s``), the rows added in the token's own top-k order
    (``vk.moe_combine``, as ``fused_moe`` adds them), cast once: ``[T, H]``."""
    t, k = ids.shape
    owner = ids.long() // per_rank
    tok = torch.arange(t, device=ids.device).unsqueeze(1).expand(t, k)
    rank = torch.arange(k, device=ids.device).unsqueeze(0).expand(t, k)
    return vk.moe_combine(back[owner, tok, rank], weights, dtype)


class ExpertParallelExperts(nn.Module):
    """One rank's shard of a sparse layer's routed experts, in the place of the block's ``experts``: the same
    parameter names (``gate_up_proj [E/W, 2I, H]``, ``down_proj [E/W, H, I]``) and call, the exchange around the
    grouped GEMM (see the module docstring)."""

    def __init__(self, experts: nn.Module, shard: range, top_k: int, exchange: _Exchange):
        super().__init__()
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[shard.start : shard.stop].clone(), False)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[shard.start : shard.stop].clone(), False)
        self.first, self.per_rank, self.top_k = shard.start, len(shard), top_k
        self.exchange = exchange

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        ex = self.exchange
        t, k = topk_ids.shape
        c = ex.rows
        if ex.padded:  # every rank's rows are C; a pad row (from ex.live on) goes to no expert
            if t != c:
                raise RuntimeError(f"{t} rows in a padded step's sparse layer but the ranks agreed on {c}")
            xs = x
            pad = torch.arange(c, device=topk_ids.device) >= ex.live
            ids = topk_ids.masked_fill(pad.unsqueeze(1), -1)
        else:
            if t > c:
                raise RuntimeError(f"{t} tokens in a sparse layer but the step's exchange holds {c} rows a rank")
            xs = x.new_zeros(c, x.shape[1])
            xs[:t] = x
            ids = topk_ids.new_full((c, k), -1)  # pad rows: no expert
            ids[:t] = topk_ids
        x_all, ids_all = ex.all_gather(xs), ex.all_gather(ids)  # [W*C, H], [W*C, k]
        local = torch.where(ids_all >= 0, ids_all - self.first, -1)
        y = vk.moe_expert_outputs(x_all, self.gate_up_proj, self.down_proj, local)  # [W*C, k, H] fp32
        back = ex.all_to_all(y).view(ex.world, c, k, -1)  # block s: rank s's rows for this rank's tokens
        # a pad row's ids are -1 here: its combine never reads by what the router made of a pad token
        return _combine_home(back, ids[:t], topk_weights, self.per_rank, x.dtype)

    def idle(self) -> None:
        """Join this layer's exchange with zero rows (a rank with no work this step)."""
        dt, h = self.gate_up_proj.dtype, self.gate_up_proj.shape[2]
        dev = self.gate_up_proj.device
        ids = torch.empty(0, self.top_k, dtype=torch.int64, device=dev)
        self.forward(torch.empty(0, h, dtype=dt, device=dev), torch.empty(0, self.top_k, device=dev), ids)


def parallelize_experts(
    model: nn.Module, group=None, device: torch.device | None = None
) -> list[ExpertParallelExperts]:
    """Shard the routed experts of every sparse layer of ``model`` over ``group`` (default: the default group), in
    place: this rank keeps :func:`expert_shard`'s experts. ``device``: where the model will run (default: where it
    is), which decides where NCCL's buffers live. Returns the sharded modules in layer order."""
    exchange = _Exchange(group, device if device is not None else next(model.parameters()).device)
    shard = expert_shard(routed_experts(model), exchange.world, exchange.rank)
    out = []
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.experts = ExpertParallelExperts(m.experts, shard, m.top_k, exchange)
            out.append(m.experts)
    return out


_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<rest>(gate_proj|up_proj|down_proj)\.weight)$")
_STACKED_NAME = re.compile(r"^.*\.experts\.(gate_up_proj|down_proj)$")


def _rank_part(named_tensors, shard: range) -> list[tuple[str, torch.Tensor]]:
    """The tensors a rank holding experts ``shard`` loads, under its own names: every tensor but another rank's
    experts, expert ``e`` renamed to its local id ``e - shard.start``, a stacked expert tensor cut to the shard (a
    copy, so that a cut sent to another process carries its own rows only)."""
    out = []
    for name, tensor in named_tensors:
        name = str(name)
        m = _EXPERT_NAME.match(name)
        if m is not None:
            e = int(m["e"])
            if e in shard:
                out.append((f"{m['prefix']}.{e - shard.start}.{m['rest']}", tensor))
        elif _STACKED_NAME.match(name) is not None:
            out.append((name, tensor[shard.start : shard.stop].clone()))
        else:
            out.append((name, tensor))
    return out


class _ExpertRunner(ModelRunner):
    """A one-device runner whose steps first agree on their shape with the other ranks (:meth:`_Exchange.begin_step`):
    a decode step runs padded to the agreed size (its CUDA graph on CUDA) on every rank, or every rank runs eagerly.
    :meth:`idle` is a step with no tokens, for a rank whose scheduler had nothing to run: a pad-only padded step
    when the others run padded."""

    def __init__(self, model, config, num_blocks, max_model_len, sharded: list[ExpertParallelExperts]):
        # before the one-device runner's set-up, which captures the graphs (through the exchange) on CUDA
        self.sharded = sharded
        self.exchange = sharded[0].exchange
        self.ran = False
        self._size: int | None = None  # the padded size the ranks agreed on for this step (None: eager)
        self.num_idle_steps = 0  # steps this rank joined with no tokens of its own
        self.num_idle_padded_steps = 0  # of those, the ones it joined with a pad-only padded step
        self.num_pad_rows = 0  # pad rows of this rank's padded steps with rows of its own
        super().__init__(model, config, num_blocks, max_model_len)

    def forward(self, batch: list[ScheduledSeq], blocks: BlockManager):
        decode = len(batch) if all(item.num_new_tokens == 1 for item in batch) else None
        tokens = sum(item.num_new_tokens for item in batch)
        self._size = self.exchange.begin_step(tokens, decode, self.graph_sizes)
        self.ran = True
        return super().forward(batch, blocks)

    def padded_size(self, batch: list[ScheduledSeq]) -> int | None:
        """The size every rank agreed on for this step (:meth:`forward`), whatever this rank's own rows would take:
        a rank padding to its own size would run other collectives than the rest."""
        return self._size

    def _fill_decode(self, batch: list[ScheduledSeq], blocks: BlockManager, size: int, draw: bool = False) -> None:
        self.exchange.live.fill_(len(batch))  # after any capture (which runs pad rows only): this step's real rows
        if batch:
            self.num_pad_rows += size - len(batch)
        super()._fill_decode(batch, blocks, size, draw)

    def _capture(self, key, static, tokens: int, seqs: int, warmups: int) -> None:
        # a graph holds its exchange's shape: C is its size, every row of it padded but the live ones
        ex = self.exchange
        saved = ex.rows, ex.padded
        ex.rows, ex.padded = tokens, True
        ex.live.fill_(0)
        try:
            super()._capture(key, static, tokens, seqs, warmups)
        finally:
            ex.rows, ex.padded = saved

    def _guarded(self, capture, *args) -> None:
        # A rank whose capture fails runs its padded steps eagerly, with a replay's collectives; but a later lazy
        # capture on the other ranks would run its warm-up's collectives eagerly without it. So a capture that fails
        # on any rank drops every rank's graphs (one all-reduce a capture call, on every rank at the same point).
        error, self.graph_error = self.graph_error, None
        super()._guarded(capture, *args)
        failed = self.graph_error is not None
        if not self.exchange.any(failed):
            self.graph_error = error
        elif not failed:
            self._drop_graphs("another rank's CUDA graph capture failed: steps run eagerly (padded) on every rank")
            log.warning("%s", self.graph_error)

    @torch.no_grad()
    def idle(self, blocks: BlockManager) -> None:
        self.num_idle_steps += 1
        size = self.exchange.begin_step(0, 0, self.graph_sizes)
        with vk.use_backend(self.config.backend):
            if size is None:
                for m in self.sharded:
                    m.idle()
                return
            # the other ranks replay size's graph: so does this one, with pad rows only (no KV written, none sampled)
            self._ensure_graph(("decode", size), self._decode, size, size)
            self._fill_decode([], blocks, size)
            self._replay(("decode", size), self._decode, size, size)
            self.num_idle_padded_steps += 1


class ExpertParallelLLM(LLM):
    """An engine whose routed experts are sharded over the ranks of the default process group (expert parallelism),
    each rank with its own requests and KV cache.

    Build it on every rank with the same model and settings; give each rank its own prompts (requests without a
    seed draw from ``config.seed + rank``). ``driven=True``: rank 0 (:attr:`is_driver`) takes every request and
    control call and spreads the requests over the ranks; the others call :meth:`serve`, and rank 0 ends with
    :meth:`shutdown`. ``generate`` (or
    ``step``) must be called on every rank together: ``generate`` returns each rank's own outputs once no rank has
    unfinished requests. ``sleep``, ``wake_up`` and ``update_weights`` apply to each rank's own part; call them on
    every rank (``update_weights`` with the whole model's HF-named tensors: each rank keeps its own experts).

    Decode steps run padded to a size every rank agrees on, as CUDA graphs on CUDA (the module docstring), where a
    one-device engine with the same settings would run them padded: on CUDA unless ``enforce_eager=True``, on CPU
    with an explicit ``cuda_graph_batch_sizes``.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: nn.Module | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        mismatch: MismatchInjection | None = None,
        driven: bool = False,
        **config_kw,
    ):
        config, mismatch = _engine_settings(config, mismatch, config_kw)
        if config.async_decode:
            raise ValueError("ExpertParallelLLM does not run EngineConfig.async_decode=True (its ranks step together)")
        with vk.use_backend(config.backend):
            if vk.get_backend("moe") != "invariant":
                raise ValueError(
                    f"ExpertParallelLLM runs the invariant moe kernels only, got backend={config.backend!r} (moe "
                    "fast): the expert halves keep one device's bits, the fast baseline has no such split"
                )
        if not isinstance(driven, bool):
            raise TypeError(f"ExpertParallelLLM: driven must be True or False, got {driven!r}")
        self.driven = driven
        _require_group("ExpertParallelLLM")
        if model is None:
            model, tokenizer = _host_model("ExpertParallelLLM", model_path, tokenizer, config)
            device = torch.device(config.device)
        else:
            device = next(model.parameters()).device  # the model decides, as for one device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shard = expert_shard(routed_experts(model), self.world, self.rank)  # refused before anything is cut
        self._sharded = parallelize_experts(model, device=device)  # on the host for a loaded model: cut, then moved
        model = model.to(device)
        # steps in lockstep, one model run each (no split of mixed steps), padded decode steps only (steps with
        # prompt tokens eager), the draw eager; requests without a seed draw from config.seed + rank, so the ranks'
        # first requests differ (a copy: the caller's config is theirs)
        config = dataclasses.replace(
            config,
            async_decode=False,
            decode_streams=1,
            draw_in_graph=False,
            split_mixed_steps=False,
            cuda_graph_token_sizes=(),
            seed=config.seed + self.rank,
        )
        # The engine sizes its KV cache from GPU memory (no num_kv_blocks / kv_cache_bytes) by running the model once
        # on max_num_batched_tokens tokens: every rank does so here, together, so the sparse layers' exchange is
        # agreed for that run as for a step (the first step agrees its own)
        self._sharded[0].exchange.begin_step(config.max_num_batched_tokens)
        super().__init__(model=model, tokenizer=tokenizer, config=config, mismatch=mismatch)
        # driven: the driver's view of the other ranks' requests
        self._outbox: dict[int, list] = {}  # rank -> (request id, token ids, seeded params) to add at the next step
        self._remote: dict[str, int] = {}  # request id -> the rank that runs it
        self._remote_pending: set[str] = set()  # weights other ranks still miss after a level-2 sleep

    def _make_runner(self, model: nn.Module, num_blocks: int) -> _ExpertRunner:
        return _ExpertRunner(model, self.config, num_blocks, self.max_model_len, self._sharded)

    # ---- the loop, every rank together
    def step(self):
        """One step on every rank together; returns this rank's requests that finished in it (``driven``: the
        driver's call, which steps every rank and returns every rank's finished requests)."""
        if self._drives():
            return self._drive_step()
        return self._local_step()

    def _local_step(self):
        self.runner.ran = False
        finished = super().step()
        if not self.runner.ran:  # nothing scheduled here: join the other ranks' step with no rows of its own
            self.runner.idle(self.blocks)
        return finished

    def _more_steps(self) -> bool:
        if self.driven:
            return self.has_unfinished_requests()  # the driver's own view covers every rank
        return self.runner.exchange.any(self.has_unfinished_requests())

    # ---- driven: rank 0 takes every request and spreads them over the ranks; the others serve()
    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def _drives(self) -> bool:
        return self.driven and self.is_driver

    def _id_in_use(self, request_id: str) -> bool:
        return super()._id_in_use(request_id) or request_id in self._remote

    def add_request(self, prompt, params=None, request_id=None) -> str:
        """Queue a request. ``driven``: on the rank with the fewest unfinished requests (ties: the lower rank), with
        the seed the driver gives it (as a one-device engine would, by arrival), so where it runs changes no bit."""
        if not self._drives():
            return super().add_request(prompt, params, request_id)
        seq = self._new_sequence(prompt, params, request_id)
        load = [len(self._seqs)] + [0] * (self.world - 1)
        for r in self._remote.values():
            load[r] += 1
        target = min(range(self.world), key=lambda r: (load[r], r))
        if target == 0:
            self._seqs[seq.request_id] = seq
            self.scheduler.add(seq)
        else:
            params = dataclasses.replace(seq.params, seed=seq.seed)
            self._outbox.setdefault(target, []).append((seq.request_id, seq.prompt_token_ids, params))
            self._remote[seq.request_id] = target
        return seq.request_id

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or (self._drives() and bool(self._remote))

    def rank_of(self, request_id: str) -> int | None:
        """The rank that runs an unfinished request (``driven``, on the driver; this rank otherwise); None if it
        is not unfinished."""
        request_id = str(request_id)
        if request_id in self._remote:
            return self._remote[request_id]
        return self.rank if request_id in self._seqs else None

    def abort_request(self, request_id: str):
        """Stop a request on whichever rank runs it; returns its partial output (None if unknown)."""
        request_id = str(request_id)
        if not self._drives() or request_id not in self._remote:
            return super().abort_request(request_id)
        rank = self._remote.pop(request_id)
        queued = self._outbox.get(rank, [])
        if any(rid == request_id for rid, _, _ in queued):  # not sent yet: never reaches the rank
            self._outbox[rank] = [q for q in queued if q[0] != request_id]
            return None
        return self._control({"op": "abort", "request_id": request_id})[rank]

    def _drive_step(self):
        if self._remote_pending:
            raise RuntimeError(
                f"{len(self._remote_pending)} weight tensor(s) of other ranks, discarded by sleep(level=2), are not "
                f"reloaded yet, e.g. {sorted(self._remote_pending)[:3]}: call update_weights with them first"
            )
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): call wake_up() before step()")
        if self._weights_pending:  # refused here, before the other ranks are told to step
            raise RuntimeError(
                f"{len(self._weights_pending)} weight tensor(s) discarded by sleep(level=2) are not reloaded yet, "
                f"e.g. {sorted(self._weights_pending)[:3]}: call update_weights with them first"
            )
        message, self._outbox = {"adds": self._outbox}, {}
        dist.broadcast_object_list([message], src=0, device=self.runner.exchange.comm)
        finished = self._local_step()
        gathered = [None] * self.world
        dist.gather_object(finished, gathered, dst=0, group=None)
        for part in gathered[1:]:
            for out in part:
                self._remote.pop(out.request_id, None)
                finished.append(out)
        return finished

    def serve(self) -> int:
        """Every rank but the driver (``driven``): run steps and control messages as the driver sends them, until
        it shuts down; returns the number of steps run."""
        if not self.driven or self.is_driver:
            raise RuntimeError("serve() is for ranks 1.. of an ExpertParallelLLM(driven=True); rank 0 drives")
        comm = self.runner.exchange.comm
        steps = 0
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, device=comm)
            message = box[0]
            if message is None:
                return steps
            if "op" in message:
                if message.get("scattered"):  # this rank's own tensors follow
                    mine = [None]
                    dist.scatter_object_list(mine, None, src=0)
                    message = dict(message, tensors=mine[0])
                dist.gather_object(_answer(self._apply, message), None, dst=0)
                continue
            for rid, ids, params in message["adds"].get(self.rank, []):
                ExpertParallelLLM.add_request(self, ids, params, rid)
            dist.gather_object(self._local_step(), None, dst=0)
            steps += 1

    def shutdown(self) -> None:
        """The driver releases the other ranks from :meth:`serve`."""
        if not self._drives():
            raise RuntimeError("only rank 0 of an ExpertParallelLLM(driven=True) shuts it down")
        dist.broadcast_object_list([None], src=0, device=self.runner.exchange.comm)

    def _control(self, message: dict, parts: list | None = None) -> list:
        """Driver: a control message to every rank, applied here too; every rank's answer (rank order). ``parts``:
        one payload a rank (its ``tensors``), scattered so that each rank receives its own only. A rank's error comes
        back as its answer and is raised here."""
        if parts is not None:
            message = dict(message, scattered=True)
        dist.broadcast_object_list([message], src=0, device=self.runner.exchange.comm)
        if parts is not None:
            mine = [None]
            dist.scatter_object_list(mine, parts, src=0)
            message = dict(message, tensors=mine[0])
        answers = [None] * self.world
        dist.gather_object(_answer(self._apply, message), answers, dst=0)
        for rank, ans in enumerate(answers):
            if isinstance(ans, _StageError):
                raise RuntimeError(f"expert-parallel rank {rank}: {ans.message}")
        return answers

    def _apply(self, message: dict):
        op = message["op"]
        if op == "update_weights":  # this rank's part, already cut (_rank_part)
            return self._load_local(message["tensors"]), sorted(self._weights_pending)
        elif op == "abort":
            return LLM.abort_request(self, message["request_id"])
        elif op == "reset_prefix_cache":
            LLM.reset_prefix_cache(self)
        else:
            return _apply_sleep_wake(self, message, "expert-parallel")
        return [], sorted(self._weights_pending)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and the weights (``level`` as for one device); ``driven``: on every rank."""
        if not self._drives():
            return super().sleep(level)
        self._refuse_sleep(level)
        self._control({"op": "sleep", "level": level})

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV page; ``driven``: on every rank (each has its own cache)."""
        if not self._drives():
            return super().reset_prefix_cache()
        self._control({"op": "reset_prefix_cache"})

    def wake_up(self) -> None:
        if not self._drives():
            return super().wake_up()
        answers = self._control({"op": "wake_up"})
        self._remote_pending = {n for _, pending in answers[1:] for n in pending}

    # ---- weights: HF names of the whole model in, each rank keeps its own experts
    def _global_name(self, name: str) -> str:
        m = _EXPERT_NAME.match(name)
        return name if m is None else f"{m['prefix']}.{int(m['e']) + self.shard.start}.{m['rest']}"

    def update_weights(self, named_tensors) -> list[str]:
        """Load HF-named tensors (the whole model's names: expert ``e`` under its global id); this rank keeps the
        tensors it holds and skips other ranks' experts. Returns the names loaded here (global ids); ``driven``: the
        driver cuts each rank's part (every shared weight, that rank's experts) and sends each rank its own part
        only, and returns the names loaded on any rank."""
        if not self._drives():
            return self._load_local(_rank_part(named_tensors, self.shard))
        self._refuse_update()
        tensors = [(str(n), t.detach().to("cpu")) for n, t in named_tensors]
        experts = self.shard.stop - self.shard.start
        parts = [_rank_part(tensors, range(r * experts, (r + 1) * experts)) for r in range(self.world)]
        answers = self._control({"op": "update_weights"}, parts)
        self._remote_pending = {n for _, pending in answers[1:] for n in pending}
        loaded = {n for names, _ in answers for n in names}
        return [n for n, _ in tensors if n in loaded]

    def _load_local(self, local) -> list[str]:
        """Load tensors under this rank's names (:func:`_rank_part`); returns their global names."""
        loaded = [self._global_name(n) for n in LLM.update_weights(self, local)]
        self._weights_pending.difference_update(loaded)
        return loaded

    @property
    def weights_pending_elsewhere(self) -> set[str]:
        """Driver: the weights other ranks still miss after a level-2 sleep (no step runs until they are in)."""
        return set(self._remote_pending)

    def weight_names(self) -> set[str]:
        """The checkpoint names of the weights this rank holds, experts under their global ids."""
        return {self._global_name(n) for n in super().weight_names()}

    def weight_table(self):
        """None: an expert-parallel replica's weights come with :meth:`update_weights`."""
        return None

    def load_bucket(self, buffer, specs, skip=None):
        raise NotImplementedError("ExpertParallelLLM takes weights with update_weights (HF names) for now")

    def receive_weights(self, group):
        raise NotImplementedError("ExpertParallelLLM takes weights with update_weights (HF names) for now")


__all__ = ["ExpertParallelExperts", "ExpertParallelLLM", "expert_shard", "parallelize_experts", "routed_experts"]
