"""Turn a scheduled step into tensors, run the shared model on the paged layout, sample."""

from __future__ import annotations

import torch

import vexact_kernels as vk
from vexact_models import AttentionMetadata

from .block_manager import BlockManager
from .config import EngineConfig
from .sampler import sample
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, num_blocks: int):
        self.model = model
        self.config = config
        cfg = model.config
        shape = (num_blocks, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # the model decides; config.device only places a loaded model
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim
        return per_token * block_size * torch.empty(0, dtype=dtype).element_size()

    def prepare(self, batch: list[ScheduledSeq], blocks: BlockManager):
        input_ids, positions, slots, cu, ctx = [], [], [], [0], []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            input_ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            slots += [blocks.slot(seq, p) for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            ctx.append(start + n)
        width = max(len(item.seq.block_table) for item in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int64)
        for b, item in enumerate(batch):
            tables[b, : len(item.seq.block_table)] = torch.tensor(item.seq.block_table, dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            context_lens=torch.tensor(ctx, dtype=torch.int64, device=dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, cu

    @torch.no_grad()
    def run(self, batch: list[ScheduledSeq], blocks: BlockManager) -> list[tuple[ScheduledSeq, int, float]]:
        """One forward over the step; returns (item, token, logprob) for each sequence that samples."""
        ids, pos, meta, cu = self.prepare(batch, blocks)
        with vk.use_backend(self.config.backend):
            hidden = self.model(ids, pos, meta, self.kv_caches)
            sampling = [b for b, item in enumerate(batch) if item.samples]
            if not sampling:
                return []
            rows = torch.tensor([cu[b + 1] - 1 for b in sampling], device=hidden.device)
            items = [batch[b] for b in sampling]
            params = [it.seq.params for it in items]
            logits = self.model.logits(hidden[rows])
            tokens, _ = sample(
                logits.cpu(), params, [it.seq.seed for it in items], [len(it.seq.output_token_ids) for it in items]
            )
            # The reported logprob comes from the trainer's own function (fused on GPU), on the sampled tokens.
            temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32)
            logprobs, _ = self.model.logprobs(hidden[rows], tokens.to(hidden.device), temps.to(hidden.device))
        return [
            (it, int(t), float(lp)) for it, t, lp in zip(items, tokens.tolist(), logprobs.cpu().tolist(), strict=True)
        ]
