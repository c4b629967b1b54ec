"""Offline API: ``LLM(model_path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("vexact_engine")


class LLM(LLMEngine):
    def generate(
        self,
        prompts: str | list[int] | Seq,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.

        ``sampling_params``: one :class:`SamplingParams` for every prompt, or a sequence of them, one per prompt (a
        dict raises ``TypeError``: pass ``SamplingParams(**d)``).

        A request that fails validation (empty prompt, token outside the vocabulary, too long, bad sampling params)
        does not raise: it comes back with ``ok == False``, ``finish_reason == "rejected"`` and the reason in
        ``error`` (and a logged warning); the other requests run as if it had not been there. Check ``ok`` before
        using an output.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, dict):
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got a dict {sampling_params!r}: "
                "pass SamplingParams(**it)"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params, strict=True):
            try:
                rid = self.add_request(prompt, p)
            except (ValueError, TypeError) as e:
                rid = f"rejected-{len(order)}"
                log.warning("request rejected: %s", e)
                # a rejected prompt may be anything (None, a number...): never let reporting it raise again
                ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt
                ids = ids if isinstance(ids, list) else []
                results[rid] = RequestOutput(rid, ids, [], torch.empty(0), "rejected", error=str(e))
            order.append(rid)
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm, leave=False)
        bar.update(len(results))
        while self._more_steps():
            for out in self.step():
                results[out.request_id] = out
                bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def _more_steps(self) -> bool:
        """Whether ``generate`` steps again: while requests are unfinished (an expert-parallel replica: on any rank,
        which steps together)."""
        return self.has_unfinished_requests()
