"""The demo: generate rollouts with the engine, rescore them with the trainer, and measure the mismatch.

Per (backend, dtype): the engine samples ``n`` rollouts, the trainer recomputes the logprob of every generated
token from the same weights, and we report tokens compared, tokens whose logprob differs (bitwise), the largest
|delta logprob|, and the K3 estimate of KL(rollout || trainer) that RL rollout correction monitors. The invariant
backend must give exactly 0; the fast backend (plain torch ops) is today's baseline.
"""

from __future__ import annotations

import time

import torch

from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_models import default_checkpoint, load_model
from vexact_trainer import Actor, ActorConfig, mismatch_metrics

TASKS = ["Reverse the string: ", "Add the numbers: ", "Sort the letters: ", "Count the vowels in: "]


def make_prompts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    prompts = []
    for i in range(n):
        k = int(torch.randint(4, 40, (1,), generator=g))
        body = "".join(alphabet[int(j)] for j in torch.randint(0, len(alphabet), (k,), generator=g))
        prompts.append(TASKS[i % len(TASKS)] + body)
    return prompts


def measure(model_path, backend: str, dtype: str, prompts, max_tokens: int, seed: int) -> dict:
    model = load_model(model_path, dtype=dtype)
    llm = LLM(
        model_path,
        model=model,
        config=EngineConfig(backend=backend, max_num_seqs=16, max_num_batched_tokens=64, seed=seed),
    )
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    rejected = [o.error for o in outs if not o.ok]
    if rejected:
        raise RuntimeError(f"{len(rejected)} demo prompts were rejected, e.g. {rejected[0]}")
    actor = Actor(model, ActorConfig(backend=backend))
    scored = actor.compute_log_probs([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], 1.0)
    rollout = torch.cat([o.logprobs for o in outs])
    trainer = torch.cat(scored.logprobs).cpu()
    m = mismatch_metrics(rollout, trainer, torch.ones_like(rollout))
    return {
        "backend": backend,
        "dtype": dtype,
        "tokens": m["tokens"],
        "mismatched": m["mismatched"],
        "max_delta": m["max_abs_delta"],
        "k3": m["k3_kl"],
        "gen_tok_s": rollout.numel() / gen_s,
        "sample": outs[0].text,
    }


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'backend':<10} {'dtype':<9} {'tokens':>7} {'mismatched':>11} {'max|dlogp|':>11} {'K3 KL':>10} "
        f"{'gen tok/s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        k3 = f"{r['k3']:.3e}" if r["k3"] else "0.0"
        lines.append(
            f"{r['backend']:<10} {r['dtype']:<9} {r['tokens']:>7} {r['mismatched']:>11} {r['max_delta']:>11.3e} "
            f"{k3:>10} {r['gen_tok_s']:>10.0f}"
        )
    return "\n".join(lines)


def run_demo(model_path, n_prompts: int, max_tokens: int, dtypes: list[str], seed: int) -> int:
    model_path = model_path or default_checkpoint()
    prompts = make_prompts(n_prompts, seed)
    print(f"VeXact demo: {n_prompts} rollouts x {max_tokens} tokens from {model_path}")
    rows = []
    for dtype in dtypes:
        for backend in ("invariant", "fast"):
            print(f"[{backend}/{dtype}] generating with the engine, rescoring with the trainer ...")
            rows.append(measure(model_path, backend, dtype, prompts, max_tokens, seed))
    print()
    print(format_table(rows))
    print()
    ok = all(r["mismatched"] == 0 and r["k3"] == 0.0 for r in rows if r["backend"] == "invariant")
    print("invariant backend: engine == trainer bitwise" if ok else "ERROR: invariant backend mismatched")
    print(f"sample rollout text (random tiny model): {rows[0]['sample'][:60]!r}")
    return 0 if ok else 1
