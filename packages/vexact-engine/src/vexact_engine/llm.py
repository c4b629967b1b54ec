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

        A request that fails validation comes back with ``finish_reason='rejected'`` and ``error`` set; the other
        requests run as if it had not been there.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
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
        while self.has_unfinished_requests():
            for out in self.step():
                results[out.request_id] = out
                bar.update(1)
        bar.close()
        return [results[rid] for rid in order]
