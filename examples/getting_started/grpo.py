"""A small, real GRPO loop: the VeXact engine samples, the FSDP trainer learns, the weights go back to the engine.

Task (verifiable, exact-match reward): add one to a digit, mod 10 (``"3+1="`` -> ``"4"``, ``"9+1="`` -> ``"0"``; one
answer token; ``--task add`` and ``add_mod10`` are harder two-operand variants; ``--task chain`` sums four digits
step by step in several tokens, for a policy fitted first, as examples/tim_study does). Each step: sample ``group_size``
answers per prompt with the engine (temperature 1, seeded), reward 1 for the right digit, group-normalised advantages
(GRPO), one PPO-clip update with truncated importance sampling (TIS) on the rollout/trainer ratio, then
``update_weights`` on the engine with the trainer's exact bf16 weights.

Run it twice, changing only the rollout engine's kernels:

    python examples/getting_started/grpo.py --rollout-backend invariant   # K3 KL is exactly 0.0 every step
    python examples/getting_started/grpo.py --rollout-backend fast        # today's baseline: K3 KL > 0

Each run writes ``outputs/getting_started/<backend>.jsonl`` in the current directory (one line per step; at the
repository root git ignores ``outputs/``), or ``--out PATH``; ``plot.py`` draws the two side by side. ``--save DIR``
keeps the final weights. The same command run twice writes the same lines (all but ``seconds``) and the same
weights: rollouts are seeded by step and sample, and the trainer's kernels are deterministic. The trainer
always runs the invariant kernels (it is the reference the rollouts are compared with).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vexact_engine import LLM, MismatchInjection, SamplingParams
from vexact_models import default_checkpoint, make_tiny_checkpoint, tiny_qwen3_config
from vexact_trainer import RolloutBatch, Trainer, TrainerConfig, grpo_advantages, init_distributed

HERE = Path(__file__).resolve().parent
OUTPUTS = Path("outputs") / "getting_started"  # relative to the current directory; git ignores outputs/
# a bigger random-weight model for GPU runs (same byte-level tokenizer as the committed tiny checkpoint)
MODEL_PRESETS = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32),
}  # fmt: skip


@dataclass
class RunConfig:
    model: str = "tiny"  # "tiny" (the committed checkpoint), a MODEL_PRESETS key, or a checkpoint directory
    device: str | None = None  # default: cuda when available
    rollout_backend: str = "invariant"
    task: str = "succ"
    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-3
    rollout_correction: str = "tis"
    logit_noise_std: float = 0.0  # injected mismatch (MismatchInjection): examples/tim_study sweeps it
    seed: int = 0
    out: str | None = None  # JSONL path (default: outputs/getting_started/<backend>.jsonl)
    save: str | None = None  # directory for the final weights (HF safetensors, bf16: what the engine loads)
    quiet: bool = False


def _chain(a: int, b: int, c: int, d: int) -> tuple[str, str]:
    """``"7+5+9+3="`` -> ``"12,21,24"``: the running sums written out, the last one the answer."""
    return f"{a}+{b}+{c}+{d}=", f"{a + b},{a + b + c},{a + b + c + d}"


# (prompt, answer) pairs of each task. The first three answer with one digit, so one sampled token decides the
# reward; ``chain`` (four digits summed step by step, used by examples/tim_study) writes its running sums before the
# answer and is scored on the last one (:func:`reward`).
TASKS = {
    "add": [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10) if a + b <= 9],
    "add_mod10": [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)],
    "succ": [(f"{a}+1=", str((a + 1) % 10)) for a in range(10)],
    "chain": [_chain(a, b, c, d) for a in range(10) for b in range(10) for c in range(10) for d in range(10)],
}
# tokens a response may take: the longest answer plus its end-of-text token (one byte per token)
MAX_TOKENS = {task: max(len(a) for _, a in pairs) + (task == "chain") for task, pairs in TASKS.items()}


def reward(task: str, text: str, answer: str) -> float:
    """1.0 for the right answer, else 0.0; ``chain`` compares the last comma-separated field only."""
    if task == "chain":
        return float(text.strip().split(",")[-1] == answer.split(",")[-1])
    return float(text.strip() == answer)


CORRECTIONS = ("none", "tis", "mis")

HELP = {
    "model": f"'tiny' (the committed 2-layer checkpoint), a preset of {sorted(MODEL_PRESETS)} (random weights, made "
    "in a temporary directory) or a Qwen3 checkpoint directory with a tokenizer",
    "device": "cpu or cuda; unset: cuda when available",
    "rollout_backend": "the rollout engine's kernels: invariant, fast, or fast:<op>,... (the trainer is invariant)",
    "task": f"the prompts and answers, one of {sorted(TASKS)}",
    "steps": "GRPO steps",
    "prompts_per_step": "distinct prompts per step",
    "group_size": "samples per prompt (the GRPO group)",
    "lr": "AdamW learning rate",
    "rollout_correction": f"the trainer's rollout correction, one of {CORRECTIONS}",
    "logit_noise_std": "Gaussian noise on the engine's sampling logits (injected mismatch; 0: none)",
    "seed": "seed of the prompts and of the sampling",
    "out": "JSONL file, one line per step; unset: outputs/getting_started/<rollout backend>.jsonl (current directory)",
    "save": "directory for the final weights as an HF checkpoint (bf16 safetensors, what the engine loads); unset: "
    "not saved",
    "quiet": "no progress bar and no per-step line",
}


class UsageError(Exception):
    """A bad option: :func:`main` prints it on one line and exits 2."""


def check(cfg: RunConfig) -> None:
    """Raise :class:`UsageError` naming the first option whose value is not allowed."""
    import vexact_kernels as vk

    try:
        vk.check_backend(cfg.rollout_backend)
    except ValueError as e:
        raise UsageError(f"--rollout-backend {cfg.rollout_backend!r}: {e}") from None
    if cfg.device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device {cfg.device!r}: expected cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use cpu")
    if cfg.task not in TASKS:
        raise UsageError(f"--task {cfg.task!r}: expected one of {', '.join(TASKS)}")
    if cfg.rollout_correction not in CORRECTIONS:
        raise UsageError(f"--rollout-correction {cfg.rollout_correction!r}: expected one of {', '.join(CORRECTIONS)}")
    if cfg.model != "tiny" and cfg.model not in MODEL_PRESETS and not (Path(cfg.model) / "config.json").is_file():
        raise UsageError(
            f"--model {cfg.model!r}: expected tiny, one of {sorted(MODEL_PRESETS)} or a checkpoint directory "
            "(no config.json there)"
        )
    for name in ("steps", "prompts_per_step", "group_size"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 1")
    if not cfg.logit_noise_std >= 0:
        raise UsageError(f"--logit-noise-std {cfg.logit_noise_std}: must be >= 0")


def checkpoint_for(model: str, workdir: Path) -> Path:
    if model == "tiny":
        return default_checkpoint()
    if model in MODEL_PRESETS:
        return make_tiny_checkpoint(workdir / model, tiny_qwen3_config(**MODEL_PRESETS[model]), seed=0)
    return Path(model)


def run(cfg: RunConfig) -> list[dict]:
    """Train for ``cfg.steps`` GRPO steps; returns the per-step log (also appended to the JSONL file)."""
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = init_distributed(device)
    out = Path(cfg.out) if cfg.out else OUTPUTS / f"{cfg.rollout_backend}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    rng = random.Random(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint_for(cfg.model, Path(tmp))
        n = cfg.prompts_per_step * cfg.group_size
        max_tokens = MAX_TOKENS[cfg.task]
        seq_blocks = -(-(max(len(q) for q, _ in TASKS[cfg.task]) + max_tokens) // 16)  # one byte per token
        llm = LLM(
            path,
            backend=cfg.rollout_backend,
            mismatch=MismatchInjection(logit_noise_std=cfg.logit_noise_std),
            device=device,
            max_num_seqs=n,
            max_num_batched_tokens=max(512, n),
            num_kv_blocks=max(2, seq_blocks) * n,
            block_size=16,
        )
        trainer = Trainer(
            path,
            TrainerConfig(lr=cfg.lr, max_grad_norm=1.0, rollout_correction=cfg.rollout_correction),
            mesh=mesh,
        )
        tok = llm.tokenizer
        rows = []
        bar = tqdm(range(cfg.steps), desc=f"GRPO ({cfg.rollout_backend} rollouts)", disable=cfg.quiet)
        for step in bar:
            t0 = time.perf_counter()
            problems = [rng.choice(TASKS[cfg.task]) for _ in range(cfg.prompts_per_step)]
            prompts = [tok(q, add_special_tokens=False)["input_ids"] for q, _ in problems]
            params = [
                SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=cfg.seed * 1_000_003 + step * n + i)
                for i in range(n)
            ]
            outs = llm.generate([p for p in prompts for _ in range(cfg.group_size)], params, use_tqdm=False)
            answers = [a for _, a in problems for _ in range(cfg.group_size)]
            rewards = torch.tensor(
                [
                    reward(cfg.task, tok.decode(o.token_ids, skip_special_tokens=True), ans)
                    for o, ans in zip(outs, answers, strict=True)
                ]
            )
            batch = RolloutBatch(
                [o.prompt_token_ids for o in outs],
                [o.token_ids for o in outs],
                grpo_advantages(rewards, cfg.group_size),
                rollout_logprobs=[o.logprobs for o in outs],
            )
            m = trainer.train_step(batch)
            trainer.sync_weights(llm)
            row = {
                "step": step,
                "rollout_backend": cfg.rollout_backend,
                "logit_noise_std": cfg.logit_noise_std,
                "rollout_correction": cfg.rollout_correction,
                "task": cfg.task,
                "model": cfg.model,
                "reward": float(rewards.mean()),
                "k3_kl": m.k3_kl,
                "mismatch_fraction": m.mismatch_fraction,
                "max_abs_delta": m.max_abs_delta,
                "grad_norm": m.grad_norm,
                "loss": m.loss,
                "entropy": m.entropy,
                "clip_fraction": m.clip_fraction,
                "skipped": m.skipped,
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if not cfg.quiet:
                tqdm.write(
                    f"step {step:4d}  reward {row['reward']:.3f}  k3_kl {row['k3_kl']!r}  "
                    f"mismatch {row['mismatch_fraction']:.4f}  grad_norm {row['grad_norm']:.4f}"
                )
            bar.set_postfix(reward=f"{row['reward']:.2f}", k3=f"{row['k3_kl']:.2e}")
        if cfg.save:
            trainer.save_hf_checkpoint(cfg.save)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for f in dataclasses.fields(RunConfig):
        kw = {"action": "store_true"} if f.type == "bool" else {"type": {"int": int, "float": float}.get(f.type)}
        ap.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=HELP[f.name], **kw)
    return ap


def main(argv: list[str] | None = None) -> int:
    cfg = RunConfig(**vars(parser().parse_args(argv)))
    try:
        check(cfg)
    except UsageError as e:
        print(f"grpo.py: error: {e}", file=sys.stderr)
        return 2
    if cfg.device != "cuda":
        torch.set_num_threads(1)
    rows = run(cfg)
    first, last = rows[: max(1, len(rows) // 10)], rows[-max(1, len(rows) // 10) :]
    mean = lambda xs, k: sum(r[k] for r in xs) / len(xs)  # noqa: E731
    print(
        f"{cfg.rollout_backend} rollouts: reward {mean(first, 'reward'):.3f} (first 10%) -> {mean(last, 'reward'):.3f} "
        f"(last 10%); K3 KL per step: max {max(r['k3_kl'] for r in rows)!r}, all exactly 0.0: "
        f"{all(r['k3_kl'] == 0.0 for r in rows)}"
    )
    print(f"written: {Path(cfg.out) if cfg.out else OUTPUTS / f'{cfg.rollout_backend}.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
