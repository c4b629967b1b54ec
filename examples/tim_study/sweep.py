"""TIM study: the GRPO loop of examples/getting_started with a controlled training-inference mismatch on the rollout
side, from exactly 0 upward, with and without the trainer's rollout corrections (TIS, MIS).

An arm is one rollout engine: ``exact`` (the invariant engine: K3 KL exactly 0.0), ``noise:<std>`` (the invariant
engine with ``vexact_engine.MismatchInjection(logit_noise_std=std)``: seeded Gaussian noise on its fp32 sampling logits;
it samples from and reports the logprobs of its perturbed distribution, the trainer scores the clean one),
``k3:<kl>`` (the noise whose per-token K3 KL is ``kl`` on this policy, from ``--calibration``) or ``fast`` (the
engine on the fast kernels: a real kernel mismatch). Every arm runs with every correction and seed, except
``exact``, which runs with correction none only: where the rollout's logprobs equal the trainer's, TIS and MIS change
nothing, bit for bit (tests/test_tim_study.py). Everything else (seeds, prompts, model, optimiser) is the same.

    python examples/tim_study/sweep.py                    # CPU, tiny model: outputs/tim_study/cpu.jsonl
    python examples/tim_study/sweep.py --device cuda --model-size small --out outputs/tim_study/gpu.jsonl
    python examples/tim_study/plot.py outputs/tim_study/cpu.jsonl     # -> outputs/tim_study/cpu.png

The study of README.md starts from a fitted policy (fit_policy.py) with ``--from-fitted DIR``; ``--calibrate``
measures the K3 KL of a few noise levels on it and writes the ``--calibration`` file the ``k3:`` arms read;
``--resume`` skips the cells already complete in ``--out``; ``--shard I/N`` runs every N-th cell from the I-th, so N
processes share one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import random
import shlex
import signal
import subprocess
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
    ap.add_argument(
        "--arms", default="", help="comma-separated arms: exact, noise:<std>, k3:<kl>, fast (replaces --magnitudes)"
    )
    ap.add_argument("--corrections", default="none,tis,mis", help="comma-separated rollout corrections: none, tis, mis")
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=8, help="distinct prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--lr", default="3e-3", help="AdamW learning rate; several, comma-separated: each cell per lr")
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (prompts and draws); each cell per seed")
    ap.add_argument("--task", default="succ", help="add, add_mod10, succ or chain (examples/getting_started/grpo.py)")
    ap.add_argument(
        "--from-fitted", default="", help="a fit_policy.py checkpoint: RL starts from it, on its task (replaces "
        "--model-size and --task)"
    )  # fmt: skip
    ap.add_argument("--calibrate", action="store_true", help="measure K3 KL per noise std, write --calibration, stop")
    ap.add_argument("--calibrate-stds", default="0.003,0.01,0.03,0.1", help="noise stds that --calibrate measures")
    ap.add_argument("--calibrate-prompts", type=int, default=64, help="distinct prompts --calibrate samples (each "
                    "--group-size times)")  # fmt: skip
    ap.add_argument("--k3-targets", default="1.5e-4,1.5e-3", help="K3 KL values --calibrate finds the noise std of")
    ap.add_argument(
        "--calibration", default=str(OUTPUTS / "calibration.json"), help="what --calibrate writes, k3: arms read"
    )
    ap.add_argument("--resume", action="store_true", help="keep --out and skip the cells complete in it")
    ap.add_argument("--shard", default="0/1", help="I/N: run cells I, I+N, I+2N, ... (N processes, one file each)")
    ap.add_argument(
        "--jobs", type=int, default=1, help="run the cells in this many processes (shard I writes <out stem>-I.jsonl, "
        "its log beside it; report.py merges them)"
    )  # fmt: skip
    ap.add_argument("--out", default=str(OUTPUTS / "cpu.jsonl"), help="JSONL file, one line per step per run")
    return ap


class SweepError(ValueError):
    """A bad option of this script: :func:`main` prints it on one line and exits 2."""


def _numbers(text: str, kind: type, option: str) -> list:
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise SweepError(f"{option} {text!r}: expected comma-separated {what}") from None


def k3_fit(calibration: dict) -> tuple[float, float]:
    """(a, p) of the least-squares line log K3 = log a + p log std through the calibration's points."""
    pts = [(math.log(c["std"]), math.log(c["k3_kl"])) for c in calibration["points"] if c["k3_kl"] > 0]
    if len(pts) < 2:
        raise SweepError(f"calibration: {len(pts)} point(s) with K3 > 0; need 2 to fit K3 against the noise std")
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    p = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return math.exp(my - p * mx), p


def std_for_k3(calibration: dict, k3: float) -> float:
    a, p = k3_fit(calibration)
    return (k3 / a) ** (1 / p)


def resolve_arms(args, calibration_path: Path, model: str) -> list[dict]:
    """Each arm as {arm, rollout_backend, logit_noise_std} (and k3_target for k3: arms)."""
    if not args.arms:
        return [
            {"arm": "exact" if m == 0 else f"noise:{m:g}", "rollout_backend": "invariant", "logit_noise_std": m}
            for m in _numbers(args.magnitudes, float, "--magnitudes")
        ]
    arms = []
    for spec in args.arms.split(","):
        kind, _, value = spec.partition(":")
        if spec == "exact" or spec == "fast":
            arms.append(
                {"arm": spec, "rollout_backend": "invariant" if spec == "exact" else "fast", "logit_noise_std": 0.0}
            )
        elif kind in ("noise", "k3") and value:
            try:
                x = float(value)
            except ValueError:
                x = -1.0
            if not (math.isfinite(x) and x > 0):
                raise SweepError(f"--arms {spec!r}: {kind}: takes a number > 0")
            arm = {"arm": spec, "rollout_backend": "invariant", "logit_noise_std": x}
            if kind == "k3":
                if not calibration_path.is_file():
                    raise SweepError(
                        f"--arms {spec!r}: no calibration file {str(calibration_path)!r} (run --calibrate first)"
                    )
                cal = json.loads(calibration_path.read_text())
                if Path(cal["model"]).resolve() != Path(model).resolve():
                    raise SweepError(
                        f"--arms {spec!r}: {str(calibration_path)!r} calibrates {cal['model']!r}, this sweep runs "
                        f"{model!r} (run --calibrate on it, or pass its --calibration)"
                    )
                arm.update(logit_noise_std=round(std_for_k3(cal, x), 6), k3_target=x)
            arms.append(arm)
        else:
            raise SweepError(f"--arms {spec!r}: expected exact, fast, noise:<std> or k3:<kl>")
    return arms


def _cell(r: dict) -> tuple:
    """The cell a row belongs to: (arm, correction, seed, lr)."""
    return r.get("arm"), r["rollout_correction"], r.get("seed", 0), r.get("lr")


def _complete(rows: list[dict], steps: int) -> set[tuple]:
    """The cells of ``rows`` (:func:`_cell`) that have every step 0..steps-1."""
    seen: dict[tuple, set] = {}
    for r in rows:
        seen.setdefault(_cell(r), set()).add(r["step"])
    return {k for k, v in seen.items() if v >= set(range(steps))}


def calibrate(args, grpo, model: str, task: str) -> dict:
    """K3 KL (rollout || trainer) of one GRPO-sized batch, per noise std and for the fast engine, on ``model``."""
    from vexact_engine import LLM, MismatchInjection, SamplingParams
    from vexact_trainer import Trainer, TrainerConfig, init_distributed, k3_kl

    mesh = init_distributed(args.device)
    path = grpo.checkpoint_for(model, Path(args.out).parent)
    trainer = Trainer(path, TrainerConfig(lr=0.0), mesh=mesh)
    n = args.calibrate_prompts * args.group_size
    rng = random.Random(0)
    problems = [rng.choice(grpo.TASKS[task]) for _ in range(args.calibrate_prompts)]
    points = []
    for backend, std in [("invariant", s) for s in _numbers(args.calibrate_stds, float, "--calibrate-stds")] + [
        ("fast", 0.0)
    ]:
        llm = LLM(
            path, backend=backend, mismatch=MismatchInjection(logit_noise_std=std), device=args.device,
            max_num_seqs=n, max_num_batched_tokens=max(512, n), num_kv_blocks=4 * n,
        )  # fmt: skip
        tok = llm.tokenizer
        prompts = [tok(q, add_special_tokens=False)["input_ids"] for q, _ in problems for _ in range(args.group_size)]
        params = [SamplingParams(temperature=1.0, max_tokens=grpo.MAX_TOKENS[task], seed=i) for i in range(n)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        lp = trainer.compute_log_probs([o.prompt_token_ids for o in outs], [o.token_ids for o in outs]).logprobs
        log_r = torch.cat(
            # on the host: the trainer's logprobs are on its device, the engine's outputs on the host
            [
                t.double().cpu() - torch.as_tensor(o.logprobs, dtype=torch.float64, device="cpu")
                for t, o in zip(lp, outs, strict=True)
            ]  # fmt: skip
        )
        point = {"backend": backend, "std": std, "k3_kl": float(k3_kl(log_r).mean()),
                 "tokens": log_r.numel()}  # fmt: skip
        print(f"{backend:9s} noise std {std:<6g} K3 KL {point['k3_kl']:.3e} ({point['tokens']} tokens)", flush=True)
        points.append(point)
        del llm
    cal = {
        "model": model,
        "task": task,
        "device": args.device,
        "points": [p for p in points if p["backend"] == "invariant"],
    }
    cal["fast"] = next(p for p in points if p["backend"] == "fast")
    a, pw = k3_fit(cal)
    cal["fit"] = {"a": a, "p": pw, "form": "k3_kl = a * std ** p"}
    cal["chosen"] = {f"{k:g}": std_for_k3(cal, k) for k in _numbers(args.k3_targets, float, "--k3-targets")}
    for k, std in cal["chosen"].items():
        print(f"K3 KL {k}: noise std {std:.4g}  (arm k3:{k})")
    return cal


def run_jobs(args, argv: list[str], out: Path) -> int:
    """Run the sweep as ``args.jobs`` processes, shard I (of ``args.jobs``) writing ``<out stem>-I.jsonl``; each
    checks its cells itself. The exit status is the worst of theirs."""
    procs = []
    for i in range(args.jobs):
        shard_out = out.with_name(f"{out.stem}-{i}.jsonl")
        log = shard_out.with_suffix(".log").open("a")
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--jobs", "1", "--shard", f"{i}/{args.jobs}"]
        procs.append((subprocess.Popen([*cmd, "--out", str(shard_out)], stdout=log, stderr=subprocess.STDOUT), log))
        print(f"shard {i}/{args.jobs}: {shard_out} (log {shard_out.with_suffix('.log')})", flush=True)

    def stop(signum, _frame):  # a timeout or kill of this process stops its shards too (--resume reruns their cells)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    codes = []
    try:
        for proc, log in procs:
            codes.append(proc.wait())
            log.close()
    except (SystemExit, KeyboardInterrupt):
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait()
        raise
    merge = f"python examples/tim_study/report.py {out.parent / out.stem}-*.jsonl"
    print(f"shards done, exit statuses {codes}; merge them: {merge}")
    return max(codes)


def meta_path(out: Path) -> Path:
    return out.with_name(out.stem + ".meta.jsonl")


def run_record(device: str, argv: list[str] | None) -> dict:
    """Date, device, commit and command line of one sweep invocation."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=HERE, capture_output=True, text=True)
    except OSError:  # no git: a copy of the examples outside a checkout
        commit = dirty = subprocess.CompletedProcess([], 1, "", "")
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        # COMMIT (env): the commit of a copy of the tree without git
        "commit": (commit.stdout.strip() or os.environ.get("COMMIT") or "unknown")
        + (" with local changes" if dirty.stdout.strip() else ""),
        "command": shlex.join(["python", "examples/tim_study/sweep.py", *(sys.argv[1:] if argv is None else argv)]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    grpo = _grpo()
    try:
        grpo.check(grpo.RunConfig(device=args.device))  # before anything else (a missing calibration, say)
    except grpo.UsageError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.jobs < 1:
            raise SweepError(f"--jobs {args.jobs}: must be >= 1")
        seeds = _numbers(args.seeds, int, "--seeds")
        lrs = _numbers(args.lr, float, "--lr")
        if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
            raise SweepError(f"--lr {args.lr!r}: every learning rate must be a finite number > 0")
        shard, _, n_shards = args.shard.partition("/")
        if not (shard.isdigit() and n_shards.isdigit() and int(shard) < int(n_shards)):
            raise SweepError(f"--shard {args.shard!r}: expected I/N with 0 <= I < N")
        shard, n_shards = int(shard), int(n_shards)
        model, task = args.model_size, args.task
        if args.from_fitted:
            fit = Path(args.from_fitted) / "fit.json"
            if not fit.is_file():
                raise SweepError(f"--from-fitted {args.from_fitted!r}: no fit.json there (fit_policy.py writes it)")
            model, task = args.from_fitted, json.loads(fit.read_text())["task"]
        calibration = Path(args.calibration)
        arms = [] if args.calibrate else resolve_arms(args, calibration, model)
        if args.calibrate_prompts < 1:
            raise SweepError(f"--calibrate-prompts {args.calibrate_prompts}: must be >= 1")
    except SweepError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    corrections = args.corrections.split(",")
    # every cell's settings checked before the first run starts
    try:
        for correction in corrections:
            for arm in arms or [{"rollout_backend": "invariant", "logit_noise_std": 0.0}]:
                grpo.check(
                    grpo.RunConfig(
                        model=model, device=args.device, task=task, steps=args.steps,
                        prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                        rollout_correction=correction, rollout_backend=arm["rollout_backend"],
                        logit_noise_std=arm["logit_noise_std"],
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
    if args.calibrate:
        calibration.parent.mkdir(parents=True, exist_ok=True)
        calibration.write_text(json.dumps(calibrate(args, grpo, model, task), indent=1) + "\n")
        print(f"written: {calibration}")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.jobs > 1:
        return run_jobs(args, sys.argv[1:] if argv is None else list(argv), out)
    done: set[tuple] = set()
    if args.resume and out.is_file():
        rows = []
        for line in out.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill mid-write; its cell runs again
        done = _complete(rows, args.steps)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows if _cell(r) in done))
    else:
        out.write_text("")
    with meta_path(out).open("a") as f:  # who ran what where, one line per invocation, for report.py's header
        f.write(json.dumps(run_record(args.device, argv)) + "\n")
    tmp = out.parent / f".{out.stem}.tmp.jsonl"
    t0 = time.perf_counter()
    cells = [
        (arm, correction, int(seed), lr)
        for lr in lrs
        for arm in arms
        for correction in (["none"] if args.arms and arm["arm"] == "exact" else corrections)
        for seed in seeds
    ][shard::n_shards]
    for arm, correction, seed, lr in cells:
        name = f"{arm['arm']} correction {correction:4s} seed {seed}" + (f" lr {lr:g}" if len(lrs) > 1 else "")
        if (arm["arm"], correction, seed, lr) in done:
            print(f"{name}: complete in {out}, skipped", flush=True)
            continue
        cfg = grpo.RunConfig(
            model=model,
            device=args.device,
            rollout_backend=arm["rollout_backend"],
            task=task,
            steps=args.steps,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            lr=lr,
            rollout_correction=correction,
            logit_noise_std=arm["logit_noise_std"],
            seed=seed,
            out=str(tmp),
            quiet=True,
        )
        extra = {k: v for k, v in arm.items() if k in ("arm", "k3_target")}
        rows = [dict(r, seed=seed, lr=lr, **extra) for r in grpo.run(cfg)]
        with out.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        last = rows[-max(1, len(rows) // 5) :]
        mean = lambda xs, k: sum(r[k] for r in xs) / len(xs)  # noqa: E731
        print(
            f"{name}  reward last 20% {mean(last, 'reward'):.3f}  "
            f"K3 mean {mean(rows, 'k3_kl'):.3e} max {max(r['k3_kl'] for r in rows):.3e}  "
            f"grad_norm mean {mean(rows, 'grad_norm'):.3f}  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    tmp.unlink(missing_ok=True)
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
