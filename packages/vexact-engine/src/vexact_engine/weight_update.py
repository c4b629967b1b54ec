"""Weight updates without a restart: by name (``update_weights``), by packed bucket (``load_bucket``, and
``receive_weights`` for a broadcast), or written in place by a trainer on the same GPU (``weight_table``,
``begin_weight_write`` / ``finish_weight_write``). The formats and their checks live in vexact-models
(``weight_sync.py``), shared with the trainer that sends.

``EngineWeights`` is a part of :class:`~vexact_engine.LLMEngine`; every path refuses while the engine is asleep or
has unfinished requests (their KV was computed with the old weights) and drops the prefix cache.
"""

from __future__ import annotations

import torch

from vexact_models import (
    WeightTable,
    expected_tensors,
    load_bucket,
    load_weights,
    packed_buffers,
    receive_weights,
    weight_table,
    weight_targets,
)


class EngineWeights:
    """The weight-update paths of an engine (see :class:`~vexact_engine.LLMEngine`)."""

    def _init_weights(self) -> None:
        self._targets: dict | None = None  # name -> parameter (view) for packed buckets; rebuilt after sleep/wake
        self._weight_table = None  # (WeightTable, buffers) for a colocated trainer's writes; rebuilt per allocation

    def _forget_weight_locations(self) -> None:
        """The parameters are about to get new storage (sleep): where each weight lies is found again on next use."""
        self._targets = None
        self._weight_table = None

    def update_weights(self, named_tensors) -> list[str]:
        """Load new weights by HF name, without a restart; returns the names loaded.

        ``named_tensors`` is any iterable of ``(hf_name, tensor)`` (a generator of buckets is fine: tensors are
        copied one at a time). Names, shapes and dtypes are checked; a partial update is allowed. The KV cache of
        running requests was computed with the old weights, so updating while requests are in flight is refused.
        """
        self._refuse_update()
        # cached K/V was computed with the old weights; dropped first, so a load that fails half way drops it too
        self.blocks.reset_prefix_cache()
        loaded = load_weights(self.model, named_tensors, strict=False)
        self._weights_pending.difference_update(loaded)
        if self.model.config.tie_word_embeddings and "lm_head.weight" in self._weights_pending:
            self._weights_pending.discard("lm_head.weight")
        return loaded

    def load_bucket(self, buffer: torch.Tensor, specs: list, skip=None) -> list[str]:
        """Load one packed bucket (``vexact_models.BucketPacker``'s layout: a uint8 buffer on the model's device and
        its ``TensorSpec`` list) into the parameters in place; returns the checkpoint names completed.

        Every spec is checked (name, the parameter's exact dtype and shape, byte range) before any byte is copied,
        so a bad bucket raises ``CheckpointError`` and changes nothing. Parameters keep their storage, so captured
        CUDA graphs stay valid. The copies are queued on the current stream (the caller synchronises before the
        buffer is reused). Refused while requests are unfinished or while asleep, as :meth:`update_weights`.
        """
        self._refuse_update()
        self.blocks.reset_prefix_cache()  # as update_weights: cached K/V was computed with the old weights
        if self._targets is None:
            self._targets = weight_targets(self.model)
        loaded = load_bucket(self.model, buffer, specs, targets=self._targets, skip=skip)
        self._weights_pending.difference_update(loaded)
        return loaded

    def receive_weights(self, group) -> list[str]:
        """Receive a whole weight sync broadcast by rank 0 of ``group`` (a ``vexact_models.WeightSyncGroup`` whose
        device is this engine's) and load it bucket by bucket; returns the names loaded."""
        self._refuse_update()
        return receive_weights(group, self.load_bucket)

    # ---- weights written in place by a trainer on the same GPU (the single-copy colocated path)
    def weight_table(self) -> tuple[WeightTable, list[torch.Tensor]] | None:
        """Where each checkpoint-named weight lies in the packed parameter buffers, and those buffers as bytes
        (``vexact_models.weight_table``): what a colocated trainer opens (CUDA IPC handles of the buffers) and writes
        into. None when the weights are not packed (``pack_weights=False``) or are asleep. Built once per allocation
        (waking gives the parameters new buffers), each time with a new ``key``."""
        if self.sleep_level:
            return None
        if self._weight_table is None:
            packed = packed_buffers(self.model)
            if packed is None:
                return None
            self._weight_table = weight_table(self.model, packed[0])
        return self._weight_table

    def begin_weight_write(self) -> tuple[WeightTable, list[torch.Tensor]]:
        """Before a colocated trainer writes weights straight into the parameters (``vexact_models.DirectWriter``
        over the buffers of :meth:`weight_table`): refused while asleep or with requests unfinished, as
        :meth:`update_weights`; drops the prefix cache. Returns ``(table, buffers)``. Run no step until
        :meth:`finish_weight_write` (the trainer synchronises its copies first). Parameters keep their storage, so
        captured CUDA graphs stay valid."""
        self._refuse_update()
        found = self.weight_table()
        if found is None:
            raise RuntimeError(
                "this engine's weights are not packed in flat buffers (EngineConfig.pack_weights=False, or pipeline "
                "stages): send them with load_bucket or update_weights"
            )
        self.blocks.reset_prefix_cache()  # cached K/V was computed with the old weights
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # no kernel of ours still reads the weights being overwritten
            torch.cuda.ipc_collect()  # allocations a trainer has let go of since it held them are freed now
        return found

    def finish_weight_write(self, key: str, written: bytes) -> list[str]:
        """After the trainer's copies have landed: the table slots set in ``written`` (``WeightTable.mask`` of what it
        wrote) count as loaded; returns their checkpoint names. Refused when ``key`` is not the current table's (the
        weights were re-allocated since: the bytes went to memory the engine no longer uses)."""
        table = self._weight_table[0] if self._weight_table is not None else None
        if table is None or table.key != key:
            now = table.key if table is not None else None
            raise RuntimeError(
                f"weights were written for weight table {key!r}, but the engine's weights were re-allocated since "
                f"(table now {now!r}, asleep: {bool(self.sleep_level)}): sync again"
            )
        loaded = table.completed(written)
        self._weights_pending.difference_update(loaded)
        return loaded

    def weight_names(self) -> set[str]:
        """The checkpoint names of the weights this engine holds (stacked experts one by one, as published
        checkpoints and the trainer's export name them): what a full :meth:`update_weights` sends."""
        return set(expected_tensors(self.model))

    def _refuse_update(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"update_weights while asleep (level {self.sleep_level}): call wake_up() first")
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"update_weights with {len(self._seqs)} unfinished request(s): finish or abort them first"
            )
