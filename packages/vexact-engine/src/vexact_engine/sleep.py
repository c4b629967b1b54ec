"""Sleep and wake: free the engine's device memory (KV cache, CUDA graphs, weights) so that a colocated trainer can
use the device, and restore it afterwards.

``EngineSleep`` is a part of :class:`~vexact_engine.LLMEngine`; it reads the engine's model, runner, block manager
and config, and keeps the host copies of what it freed.
"""

from __future__ import annotations

import torch

from vexact_models import allocate_packed, pack_parameters


class EngineSleep:
    """``sleep(level)`` / ``wake_up()`` of an engine (see :class:`~vexact_engine.LLMEngine`)."""

    def _init_sleep(self) -> None:
        self.sleep_level = 0  # 0: awake; 1 or 2: see sleep()
        self._host_copies: dict[str, torch.Tensor] = {}  # weights offloaded by sleep(level=1), reused across cycles
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._weights_pending: set[str] = set()  # names to reload after sleep(level=2)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache, the CUDA graphs and the weights' device memory.

        ``level=1`` keeps the weights in (pinned) host memory and restores them on :meth:`wake_up`; ``level=2``
        discards the parameters: after :meth:`wake_up` the caller must load every one with :meth:`update_weights`
        before the next step. Buffers (DeepSeek's fp32 ``e_score_correction_bias`` too) are kept in host memory at
        either level and come back bit for bit. Refused while requests are unfinished (their KV would be lost):
        finish or abort them first. Requests may be added while asleep; they run after waking. On CPU the same
        happens with host storages.
        """
        self._refuse_sleep(level)
        self.runner.release()
        self._forget_weight_locations()
        self.blocks.reset_prefix_cache()  # the cached pages' K/V goes with the KV cache
        on_cuda = self.runner.device.type == "cuda"
        for name, t, is_param in self._named_tensors():
            self._shapes[name] = (t.shape, t.dtype)
            # Buffers are kept at either level, bit for bit: rotary tables are no weights, and DeepSeek's fp32 bias
            # buffer (a checkpoint tensor, which an update may also send) stays valid when a sender omits it.
            if level == 1 or not is_param:
                if on_cuda:
                    host = self._host_copies.get(name)
                    if host is None or host.shape != t.shape or host.dtype != t.dtype:
                        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        self._host_copies[name] = host
                    host.copy_(t.data, non_blocking=True)
                else:
                    self._host_copies[name] = t.data  # the host storage is the copy; the model lets go of it
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if level == 2:
            for name, _, is_param in self._named_tensors():
                if is_param:
                    self._host_copies.pop(name, None)
        if on_cuda:
            torch.cuda.synchronize(self.runner.device)  # the copies must land before the storages are freed
            torch.cuda.empty_cache()
        self.sleep_level = level

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed: weights (level 1; level 2 leaves them to :meth:`update_weights`),
        the KV cache and the CUDA graphs. A no-op when awake."""
        if not self.sleep_level:
            return
        dev = self.runner.device
        pack = self.config.pack_weights
        for name, t, is_param in self._named_tensors():
            shape, dtype = self._shapes[name]
            if self.sleep_level == 2 and is_param:
                if not pack:  # packed: allocated below, all at once
                    t.data = torch.empty(shape, dtype=dtype, device=dev)
            else:
                host = self._host_copies[name]
                # packed parameters point at their host copy for now; pack_parameters copies them into the buffers
                t.data = host.to(dev, non_blocking=True) if dev.type == "cuda" and not (pack and is_param) else host
                if dev.type != "cuda":
                    del self._host_copies[name]
        if pack and self.sleep_level == 2:
            params = {name for name, _, is_param in self._named_tensors() if is_param}
            allocate_packed(self.model, {name: self._shapes[name] for name in params}, dev)
        elif pack:
            pack_parameters(self.model, dev)  # on CPU the host copies are the packed views: nothing to do
        if self.sleep_level == 2:
            kept = {name for name, _ in self.model.named_buffers()}
            self._weights_pending = self.weight_names() - kept
        self.runner.allocate()
        self.sleep_level = 0

    def _refuse_sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level!r}")
        if self.sleep_level:
            raise RuntimeError(f"the engine is already asleep (level {self.sleep_level}); call wake_up() first")
        if self.has_unfinished_requests():
            raise RuntimeError(f"sleep with {len(self._seqs)} unfinished request(s): finish or abort them first")

    def _named_tensors(self):
        """(name, tensor, is_parameter) for every distinct parameter and buffer of the model (tied ones once)."""
        seen = set()
        for name, p in self.model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p, True
        for name, b in self.model.named_buffers():
            if id(b) not in seen:
                seen.add(id(b))
                yield name, b, False
