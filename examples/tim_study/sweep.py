"""TIM study: the GRPO loop of examples/getting_started with a controlled training-inference mismatch injected on the
rollout side, swept from exactly 0 upward, with and without the trainer's rollout corrections (TIS, MIS).

The injection is ``vexact_engine.MismatchInjection(logit_noise_std=...)``: seeded Gaussian noise of that standard
deviation on the engine's fp32 sampling logits; the engine samples from and reports the logprobs of its own perturbed
distribution, the trainer (invariant kernels) scores the clean one. Magnitude 0 is the invariant engine: K3 KL exactly
0.0. Everything else (seeds, prompts, model, optimiser) is the same across runs, so the magnitude is the only thing that
changes.

    python examples/tim_study/sweep.py                    # CPU, tiny model: outputs/tim_study/cpu.jsonl
    python examples/tim_study/sweep.py --device cuda --model-size small --out outputs/tim_study/gpu.jsonl
    python examples/tim_study/plot.py outputs/tim_study/cpu.jsonl     # -> outputs/tim_study/cpu.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUTPUTS = Path("outputs") / "tim_study"  # relative to the current directory; git ignores outputs/
RENAMED = {"--model ": "--model-size ", "--rollout-correction ": "--corrections "}  # grpo.py's option -> this one's


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
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--model-size", default="tiny", help="tiny (the committed checkpoint) or small (GPU preset)")
    ap.add_argument("--magnitudes", default="0,0.1,1.0", help="comma-separated logit noise standard deviations")
    ap.add_argument("--corrections", default="none,tis,mis", help="comma-separated rollout corrections: none, tis, mis")
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=8, help="distinct prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (prompts and draws); each cell per seed")
    ap.add_argument("--task", default="succ", help="add, add_mod10 or succ (examples/getting_started/grpo.py)")
    ap.add_argument("--out", default=str(OUTPUTS / "cpu.jsonl"), help="JSONL file, one line per step per run")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    grpo = _grpo()
    try:
        magnitudes = [float(m) for m in args.magnitudes.split(",")]
    except ValueError:
        print(f"sweep.py: error: --magnitudes {args.magnitudes!r}: expected comma-separated numbers", file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"sweep.py: error: --seeds {args.seeds!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    # every cell's settings checked before the first run starts
    try:
        for correction in args.corrections.split(","):
            for mag in magnitudes:
                grpo.check(
                    grpo.RunConfig(
                        model=args.model_size, device=args.device, task=args.task, steps=args.steps,
                        prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                        rollout_correction=correction, logit_noise_std=mag,
                    )
                )  # fmt: skip
    except grpo.UsageError as e:
        msg = str(e)
        for grpo_name, name in RENAMED.items():
            msg = msg.replace(grpo_name, name)
        print(f"sweep.py: error: {msg}", file=sys.stderr)
        return 2
    if args.device != "cuda":
        torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    tmp = out.parent / ".tim_study_tmp.jsonl"
    t0 = time.perf_counter()
    cells = [
        (correction, float(mag), int(seed))
        for correction in args.corrections.split(",")
        for mag in magnitudes
        for seed in seeds
    ]
    for correction, mag, seed in cells:
        cfg = grpo.RunConfig(
            model=args.model_size,
            device=args.device,
            task=args.task,
            steps=args.steps,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            lr=args.lr,
            rollout_correction=correction,
            logit_noise_std=mag,
            seed=seed,
            out=str(tmp),
            quiet=True,
        )
        rows = [dict(r, seed=seed) for r in grpo.run(cfg)]
        with out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        last = rows[-max(1, len(rows) // 5) :]
        mean = lambda xs, k: sum(r[k] for r in xs) / len(xs)  # noqa: E731
        print(
            f"correction {correction:4s} noise {mag:<5g} seed {seed}  reward last 20% {mean(last, 'reward'):.3f}  "
            f"K3 mean {mean(rows, 'k3_kl'):.3e} max {max(r['k3_kl'] for r in rows):.3e}  "
            f"grad_norm mean {mean(rows, 'grad_norm'):.3f}  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    tmp.unlink(missing_ok=True)
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
