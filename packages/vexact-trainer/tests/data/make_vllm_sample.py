"""Write vllm_sample.jsonl (run from the repo root): vLLM RequestOutput-shaped rows from our fast engine."""

import json

import torch

import vexact_kernels as vk
from vexact_engine import LLM, SamplingParams
from vexact_models import AttentionMetadata, default_checkpoint

T = 0.8
llm = LLM(default_checkpoint(), backend="fast", max_num_seqs=4, max_num_batched_tokens=64)
prompts = [[17, 42, 7], [5, 6, 7, 8], [100, 3]]
outs = llm.generate([p for p in prompts for _ in range(2)], SamplingParams(temperature=T, max_tokens=6, seed=3))
rows = []
for i, p in enumerate(prompts):
    comps = []
    for j in range(2):
        o = outs[2 * i + j]
        ids = torch.tensor(p + o.token_ids)
        with vk.use_backend("fast"), torch.no_grad():  # the engine's full distribution, for each token's rank
            h = llm.model(ids, torch.arange(len(ids)), AttentionMetadata.packed([len(ids)]))
            logits = llm.model.logits(h)[len(p) - 1 : -1] / T
        lps = []
        for k, (t, lp) in enumerate(zip(o.token_ids, o.logprobs.tolist(), strict=True)):
            entry = {str(t): {"logprob": lp, "rank": int((logits[k] > logits[k, t]).sum()) + 1, "decoded_token": None}}
            top = int(logits[k].argmax())
            if top != t:
                top_lp = float(torch.log_softmax(logits[k], -1)[top])
                entry[str(top)] = {"logprob": top_lp, "rank": 1, "decoded_token": None}
            lps.append(entry)
        cum = float(o.logprobs.double().sum())
        comps.append({"index": j, "text": "", "token_ids": o.token_ids, "cumulative_logprob": cum, "logprobs": lps})
        comps[-1]["finish_reason"] = o.finish_reason
    sp = {"temperature": T, "n": 2, "logprobs": 1, "seed": 3}
    rows.append({"request_id": str(i), "prompt_token_ids": p, "sampling_params": sp, "outputs": comps})
with open("packages/vexact-trainer/tests/data/vllm_sample.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
