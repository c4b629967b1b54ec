"""Turn a scheduled step into tensors, run the shared model on the paged layout, sample.

:meth:`ModelRunner.launch` is a step: :meth:`~ModelRunner.forward` (the step's tensors, the model, the hidden rows of
the sequences that sample), then the draw (``sampler.sample_rows_on_device``: logits or the fused draw, seeded, and
the reported logprob from the trainer's own function, on the model's device); :meth:`~ModelRunner.run` reads it
back. A pipeline stage reuses the halves (``step_inputs.py``, ``sampler.py``).

A step runs eagerly (:meth:`~ModelRunner.prepare` builds its tensors) or padded to a fixed shape from static buffers,
replayed as a CUDA graph on CUDA; the padded steps and their capture live in ``cuda_graphs.py``
(:class:`~vexact_engine.cuda_graphs.CudaGraphs`, which the runner is). Padding never changes a real row's numerics.
A step with decode rows and prompt chunks runs as two launches, the decode rows padded (their graph, their in-graph
draw) and the prompt chunks on their own (``EngineConfig.split_mixed_steps``; :meth:`~ModelRunner.split_mixed`,
:func:`join_rows`): row-invariant kernels make it the one launch's bits.

With ``EngineConfig.async_decode``, :meth:`ModelRunner.launch` queues a step and returns without reading its results
(``in_flight.LaunchedStep``); the engine launches the next step first. A row whose input token that step drew is
not on the host yet: ``step_lists`` gives it a placeholder id and names its drawn row, and the device copies the
drawn token in before the step runs (``in_flight.feed_drawn``). On CUDA the step's inputs then go over through
pinned memory without waiting for the step before it. Positions, KV slots and block tables need no token, so the host
prepares them as without it.
"""

from __future__ import annotations

import torch

import vexact_kernels as vk

from .ablation import MismatchInjection
from .block_manager import BlockManager
from .config import EngineConfig
from .cuda_graphs import CudaGraphs
from .in_flight import LaunchedStep, feed_drawn
from .sampler import sample_rows_on_device
from .scheduler import ScheduledSeq
from .step_inputs import host_tensor, step_lists, step_tensors


def kv_cache_shapes(model_config, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One layer's K and V cache shapes, from what the model says its cache holds per token
    (``config.kv_cache_dims = (kv_heads, k_head_dim, v_head_dim)``; MLA's K and V differ in width)."""
    heads, dk, dv = model_config.kv_cache_dims
    return (num_blocks, block_size, heads, dk), (num_blocks, block_size, heads, dv)


def join_rows(launches: list[tuple[torch.Tensor | None, list[ScheduledSeq]]]) -> tuple[torch.Tensor | None, list]:
    """One step's ``(tokens-and-logprobs rows, sampling sequences)`` from its launches' (each ``[2, >= S]`` on the
    device, or None where no sequence samples), in launch order."""
    parts = [(both[:, : len(items)], items) for both, items in launches if items]
    if not parts:
        return None, []
    return torch.cat([both for both, _ in parts], 1), [item for _, items in parts for item in items]


class ModelRunner(CudaGraphs):
    """One engine's model on one device with its KV cache: :meth:`launch` (or :meth:`run`) turns a scheduled step
    into tokens and logprobs."""

    mismatch: MismatchInjection | None = None  # a study tool, set by the engine that asks for one

    def __init__(self, model: torch.nn.Module, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.model = model
        self.config = config
        self.num_blocks = num_blocks
        cfg = model.config
        self.kv_shapes = kv_cache_shapes(cfg, num_blocks, config.block_size)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # the model decides; config.device only places a loaded model
        # Static block tables are as wide as the longest sequence can need, so one capture serves every step.
        self.max_pages = -(-max_model_len // config.block_size)
        self._init_graphs(config)
        self.async_decode = config.async_decode
        self._drawn: torch.Tensor | None = None  # async_decode: the last launched step's drawn tokens, int64 [S]
        self.num_fed_rows = 0  # async_decode: rows whose input token came from the device (drawn a step before)
        self.num_split_steps = 0  # steps run as a padded decode launch and a launch of their prompt chunks
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.allocate()

    # ---- a step
    def run(self, batch: list[ScheduledSeq], blocks: BlockManager) -> list[tuple[ScheduledSeq, int, float]]:
        """One step: forward, then sample; returns (item, token, logprob) for each sequence that samples."""
        return self.launch(batch, blocks).results()

    @torch.no_grad()
    def launch(self, batch: list[ScheduledSeq], blocks: BlockManager) -> LaunchedStep:
        """Queue one step (forward, then sample) and return it unread; its ``results()`` wait for it. With
        ``async_decode`` the drawn tokens also stay on the device, where the next step's rows read them."""
        if self.kv_caches is None:
            raise RuntimeError("the engine is asleep (KV cache released): call wake_up() first")
        parts = self.split_mixed(batch)
        if parts is None:
            both, items = self._launch_rows(batch, blocks)
        else:
            # decode rows first: a prompt chunk of this step may read a page a decode row of it fills (the prefix
            # cache registers pages as they are scheduled), so those writes go first, as in one launch
            launches = []
            for part in parts:
                both, items = self._launch_rows(part, blocks)
                # a replayed graph's output (the decode half's draw) lives in the graphs' shared memory pool, which
                # the next launch's graph reuses: copied out before that launch
                launches.append((None if both is None else both[:, : len(items)].clone(), items))
            both, items = join_rows(launches)
            self.num_split_steps += 1
        if self.async_decode:
            self._drawn = both[0, : len(items)].to(torch.int64) if items else None
        return LaunchedStep(items, both, read_later=self.async_decode)

    def split_mixed(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]] | None:
        """``(one-token rows, prompt chunks)`` of a step that holds both, when the one-token rows can run as a padded
        decode step (``EngineConfig.split_mixed_steps``); else None (the step runs as one launch).

        The one-token rows run first and read only pages earlier steps wrote; a pair of launches keeps the one
        launch's bits only so. A sequence admitted in this step stays with the prompt chunks whatever its length: the
        prefix pages it took from the cache may be pages another sequence admitted before it fills in this step
        (the samples of a GRPO group), written in the prompt chunks' launch."""
        if not self.config.split_mixed_steps or not self.graph_sizes:
            return None
        decode = [item for item in batch if item.num_new_tokens == 1 and not item.admitted]
        if not decode or len(decode) == len(batch) or self.padded_size(decode) is None:
            return None
        rest = [item for item in batch if item.num_new_tokens != 1 or item.admitted]
        return decode, rest

    def _launch_rows(self, batch: list[ScheduledSeq], blocks: BlockManager) -> tuple[torch.Tensor | None, list]:
        """Queue one launch of ``batch``: ``([2, >= S] tokens and logprobs on the device or None, the S sequences
        that sample)``. Its fed rows read the drawn tokens of the last launched step (``self._drawn``)."""
        size = self.graph_draw_size(batch)
        if size is not None:
            return self._forward_with_draw(batch, blocks, size), batch
        hidden, items = self.forward(batch, blocks)
        return self._sample_on_device(hidden, items), items

    @torch.no_grad()
    def forward(self, batch: list[ScheduledSeq], blocks: BlockManager) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run the model over the step; returns the pre-norm hidden rows ``[S, H]`` of the ``S`` sequences that
        sample in it, and those sequences."""
        sampling = [b for b, item in enumerate(batch) if item.is_last_chunk]
        items = batch if len(sampling) == len(batch) else [batch[b] for b in sampling]
        size = self.padded_size(batch)
        tokens = self.padded_tokens(batch) if size is None else None
        with vk.use_backend(self.config.backend):
            if size is not None:
                self._ensure_graph(("decode", size), self._decode, size, size)
                self._fill_decode(batch, blocks, size)
                self.num_padded_steps += 1
                hidden = self._replay(("decode", size), self._decode, size, size)
                if len(sampling) == len(batch):
                    return hidden[: len(batch)], items
                # one-token prefill chunks also run padded; a step may have no row that samples
                return hidden[host_tensor(sampling, hidden.device)], items
            if tokens is not None:
                self._ensure_graph(("prompt", tokens), self._prompt, tokens, self.prompt_seqs)
                cu = self._fill_prompt(batch, blocks, tokens)
                self.num_padded_prompt_steps += 1
                hidden = self._replay(("prompt", tokens), self._prompt, tokens, self.prompt_seqs)
            else:
                ids, pos, meta, cu = self.prepare(batch, blocks)
                hidden = self.model(ids, pos, meta, self.kv_caches)
        return hidden[host_tensor([cu[b + 1] - 1 for b in sampling], hidden.device)], items

    @torch.no_grad()
    def sample(self, hidden: torch.Tensor, items: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, int, float]]:
        """Draw each sequence's next token from its hidden row; returns ``(item, token, logprob)``.

        The reported logprob comes from the trainer's own function (``model.logprobs``) on the sampled tokens.
        One host sync, for the results.
        """
        return LaunchedStep(items, self._sample_on_device(hidden, items), read_later=False).results()

    def _sample_on_device(self, hidden: torch.Tensor, items: list[ScheduledSeq]) -> torch.Tensor | None:
        if not items:
            return None
        return sample_rows_on_device(
            self.model,
            self.config.backend,
            hidden,
            [it.seq.params for it in items],
            [it.seq.seed for it in items],
            # the token index counts a token still in flight (async_decode)
            [len(it.seq.output_token_ids) + it.seq.num_pending for it in items],
            self.mismatch,
        )

    # ---- eager step
    def prepare(self, batch: list[ScheduledSeq], blocks: BlockManager):
        """The step's ``input_ids [T]``, ``positions [T]``, paged ``AttentionMetadata`` and host ``cu_seqlens``."""
        step = step_lists(batch, blocks)
        ids, pos, meta = step_tensors(step, self.device)
        if step["feed_dst"]:
            self.num_fed_rows += len(step["feed_dst"])
            dst, src = (host_tensor(step[k], self.device) for k in ("feed_dst", "feed_src"))
            feed_drawn(ids, dst, src, self._drawn)
            vk.record_range(ids, 0, self.model.config.vocab_size - 1)  # drawn tokens lie in the vocabulary
        return ids, pos, meta, step["cu"]

    # ---- memory
    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        heads, dk, dv = model_config.kv_cache_dims
        per_token = model_config.num_hidden_layers * heads * (dk + dv)
        return per_token * block_size * torch.empty(0, dtype=dtype).element_size()

    def allocate(self) -> None:
        """Allocate the KV cache and the static step buffers; capture the CUDA graphs on CUDA (after a wake_up
        with ``graph_recapture="lazy"``, the largest of each kind now and the others at their first step)."""
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in self.kv_shapes)
            for _ in range(self.model.config.num_hidden_layers)
        ]
        if self.graph_sizes or self.token_sizes:
            self._allocate_static()
            if self.device.type == "cuda":
                self.capture_seconds, self.captured_at_steps, self.capture_reserved_bytes = 0.0, 0, 0
                lazy = self.captures > 0 and self.config.graph_recapture == "lazy"
                self._guarded(self._capture_all, lazy)

    def release(self) -> None:
        """Drop the graphs, their memory pool, the static buffers and the KV cache (see ``LLMEngine.sleep``)."""
        self._graphs.clear()
        self._draws.clear()
        self._uncaptured.clear()
        self._graph_pool = None
        self._decode = self._prompt = self._prompt_out = None
        self._drawn = None
        self.kv_caches = None
