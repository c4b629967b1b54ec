"""Fit the TIM study's policy: a small Qwen3 (byte vocabulary) trained with supervision on grpo.py's ``chain`` task
until it solves about a third of the problems when sampled at temperature 1, so GRPO starts from a policy that is
neither random nor done.

The task sums four digits step by step (``"7+5+9+3="`` -> ``"12,21,24"`` then end-of-text): the running sums are the
reasoning tokens, the last one the answer. Fitting is plain next-token cross-entropy on the worked solutions with
the trainer (REINFORCE with advantage 1 is exactly that loss; the ``fast`` kernels, as no logprob is compared here).
Every ``--eval-every`` steps the rollout engine, synced with the trainer's weights as in GRPO, samples each held-out
problem once at temperature 1; fitting stops at the first evaluation whose mean reward (GRPO's starting reward) is at
or above ``--target``. It then writes an HF-layout checkpoint (config.json, safetensors, the byte tokenizer) that the
engine and the trainer load, and ``fit.json`` beside it: the settings, the reward and the probability of the whole
worked solution (exp of its summed logprobs) at each evaluation.

    python examples/tim_study/fit_policy.py --preset tiny --steps 20          # CPU, seconds (tests)
    python examples/tim_study/fit_policy.py --device cuda --preset small      # GPU: ~25M parameters, minutes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
OUTPUTS = Path("outputs") / "tim_study"  # relative to the current directory; git ignores outputs/
TASK = "chain"
# Model sizes (overrides of vexact_models.tiny_qwen3_config): tiny for CPU tests, small for the GPU study (~25M).
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}  # fmt: skip
HELD_OUT = 256  # problems never trained on; evaluation and the engine's check sample them


def _grpo():
    spec = importlib.util.spec_from_file_location("grpo", HERE.parent / "getting_started" / "grpo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["grpo"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--preset", default="tiny", help=f"model size, one of {sorted(PRESETS)}")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--steps", type=int, default=3000, help="most optimizer steps (stops earlier at --target)")
    ap.add_argument("--batch-size", type=int, default=128, help="worked solutions per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up from 0")
    ap.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    ap.add_argument("--target", type=float, default=0.35, help="stop at the first evaluation at or above this")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the split and the batches")
    ap.add_argument("--out", default=str(OUTPUTS / "policy"), help="checkpoint directory to write")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def check(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the first option whose value is not allowed."""
    if args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r}: expected one of {', '.join(sorted(PRESETS))}")
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r}: expected cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use cpu")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0")
    for name in ("steps", "batch_size", "eval_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr {args.lr}: must be a finite number > 0")
    if not 0.0 < args.target < 1.0:
        raise ValueError(f"--target {args.target}: must be in (0, 1)")


def solution_probability(trainer, prompts, solutions) -> float:
    """Mean over problems of exp(sum of the response's logprobs): the chance a temperature-1 sample is the worked
    solution token for token."""
    out = trainer.compute_log_probs(prompts, solutions)
    return float(torch.stack([lp.double().sum().exp() for lp in out.logprobs]).mean())


def engine_reward(llm, grpo, problems, tok, seed: int) -> float:
    """The mean reward of one temperature-1 sample per problem, drawn by the rollout engine ``llm``."""
    from vexact_engine import SamplingParams

    n = len(problems)
    params = [SamplingParams(temperature=1.0, max_tokens=grpo.MAX_TOKENS[TASK], seed=seed + i) for i in range(n)]
    outs = llm.generate([tok(q, add_special_tokens=False)["input_ids"] for q, _ in problems], params, use_tqdm=False)
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    return sum(grpo.reward(TASK, t, a) for t, (_, a) in zip(texts, problems, strict=True)) / n


def fit(args: argparse.Namespace) -> dict:
    """Fit, save the checkpoint to ``args.out`` and return what ``fit.json`` records."""
    from transformers import AutoTokenizer

    from vexact_engine import LLM
    from vexact_models import default_checkpoint, make_tiny_checkpoint, tiny_qwen3_config
    from vexact_trainer import RolloutBatch, Trainer, TrainerConfig, init_distributed

    grpo = _grpo()
    torch.manual_seed(args.seed)
    mesh = init_distributed(args.device)
    problems = list(grpo.TASKS[TASK])
    random.Random(args.seed).shuffle(problems)
    held_out, train = problems[:HELD_OUT], problems[HELD_OUT:]
    tok = AutoTokenizer.from_pretrained(default_checkpoint())
    eos = tok.eos_token_id
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eval_prompts = [encode(q) for q, _ in held_out]
    eval_solutions = [encode(a) + [eos] for _, a in held_out]
    rng = random.Random(args.seed + 1)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        init = make_tiny_checkpoint(Path(tmp) / "init", tiny_qwen3_config(**PRESETS[args.preset]), seed=args.seed)
        trainer = Trainer(
            init,
            TrainerConfig(lr=args.lr, max_grad_norm=1.0, policy_loss="reinforce", backend="fast"),
            mesh=mesh,
        )
        n = HELD_OUT  # the engine samples the held-out problems with the trainer's weights at every evaluation
        llm = LLM(init, device=args.device, max_num_seqs=n, max_num_batched_tokens=max(512, n), num_kv_blocks=2 * n)
    params = sum(p.numel() for p in trainer.model.parameters())

    def evaluate(step: int, loss: float | None) -> dict:
        trainer.sync_weights(llm)
        row = {
            "step": step,
            "loss": loss,
            "reward": engine_reward(llm, grpo, held_out, tok, seed=args.seed * 1_000_003),
            "p_solution": solution_probability(trainer, eval_prompts, eval_solutions),
        }
        history.append(row)
        return row

    history, t0 = [], time.perf_counter()
    last = evaluate(0, None)
    bar = tqdm(range(1, args.steps + 1), desc=f"fit {args.preset} ({params / 1e6:.1f}M)", disable=args.quiet)
    step = 0
    for step in bar:
        batch = [rng.choice(train) for _ in range(args.batch_size)]
        for group in trainer.optimizer.param_groups:  # without warm-up the small preset's loss jumps at step 2
            group["lr"] = args.lr * min(1.0, step / args.warmup) if args.warmup else args.lr
        m = trainer.train_step(
            RolloutBatch([encode(q) for q, _ in batch], [encode(a) + [eos] for _, a in batch], [1.0] * len(batch))
        )
        if step % args.eval_every == 0 or step == args.steps:
            last = evaluate(step, m.loss)
            bar.set_postfix(loss=f"{m.loss:.3f}", reward=f"{last['reward']:.3f}")
            if last["reward"] >= args.target:
                break
    seconds = time.perf_counter() - t0
    if out.exists():
        shutil.rmtree(out)
    trainer.save_hf_checkpoint(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_checkpoint() / name, out / name)
    record = {
        "task": TASK,
        "preset": args.preset,
        "model": PRESETS[args.preset],
        "parameters": params,
        "device": args.device,
        "seed": args.seed,
        "lr": args.lr,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "steps": step,
        "target": args.target,
        "reached_target": last["reward"] >= args.target,
        "reward": last["reward"],
        "p_solution": last["p_solution"],
        "seconds": seconds,
        "history": history,
    }
    (out / "fit.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        print(f"fit_policy.py: error: {e}", file=sys.stderr)
        return 2
    if args.device != "cuda":
        torch.set_num_threads(1)
    r = fit(args)
    print(
        f"{r['preset']} ({r['parameters'] / 1e6:.1f}M parameters): {r['steps']} steps in {r['seconds']:.0f} s; "
        f"held-out reward at temperature 1 {r['reward']:.3f} (engine), p(worked solution) {r['p_solution']:.3f}"
    )
    if not r["reached_target"]:
        print(f"fit_policy.py: warning: --target {args.target} not reached in {args.steps} steps", file=sys.stderr)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
