"""``vexact tim``: measure any engine's training-inference mismatch against the invariant trainer, and attribute
ours to op families.

``vexact tim rescore FILE``: rescore a rollout file (vLLM, verl, vexact layouts; see
:func:`vexact_trainer.load_rollouts`) with the trainer on the invariant kernels and write ``summary.json``, PNG
plots and ``report.html`` under ``--out``.

``vexact tim attribute``: run our engine with the ``fast`` kernel of one op family at a time (the rest invariant) on
the same prompts and sampling seeds, rescore each run's rollouts with the invariant trainer, and report each family's
share of the mismatch. Mode ``engine`` (default) re-generates with each backend: every run's mismatch is measured on
its own samples, exactly the quantity an RL run sees (decode path, paged attention and batch effects included); the
sampled tokens may differ between runs once a logprob moves. Mode ``trainer`` scores one fixed set of invariant
rollouts with the trainer on ``fast:<family>``: the same tokens for every family, so the op's arithmetic alone is
isolated (no decode path). Shares are each family's K3 over the sum of the families' K3 (the effects need not add up:
``all`` is the whole fast backend, reported beside them).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .args import DTYPES, UsageError, check_device, check_file, check_model, check_positive

LAYOUTS = ("auto", "vexact", "vllm", "verl")  # vexact_trainer.tim.LAYOUTS, without importing the trainer for --help


def add_parser(sub) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    tim = sub.add_parser("tim", help="training-inference mismatch diagnostics", formatter_class=fmt)
    tsub = tim.add_subparsers(dest="tim_command", required=True)
    r = tsub.add_parser(
        "rescore",
        help="rescore a rollout file with the invariant trainer and report the mismatch",
        description="Rescore a rollout file with the trainer on the invariant kernels; write summary.json, PNG plots "
        "and report.html under --out.",
        formatter_class=fmt,
    )
    r.add_argument("rollouts", help="JSONL / JSON / parquet rollout file, or a verl DataProto pickle (.pkl)")
    r.add_argument("--model", default=None, help="HF checkpoint dir the rollouts came from; unset: the tiny Qwen3")
    r.add_argument("--layout", default="auto", choices=LAYOUTS, help="the rows' layout (auto: told from the rows)")
    r.add_argument("--temperature", type=float, default=None, help="sampling temperature for rows that carry none")
    r.add_argument(
        "--vllm-logprobs-mode",
        default="processed",
        choices=("processed", "raw"),
        help="vLLM rows: logprobs after temperature (processed) or before it (raw, vLLM's default)",
    )
    r.add_argument("--out", default="outputs/tim_report", help="output directory (summary.json, *.png, report.html)")
    r.add_argument("--device", default=None, help="cpu or cuda; unset: cuda when available")
    r.add_argument("--dtype", default=None, help="bfloat16, float16 or float32; unset: the checkpoint's")
    r.add_argument("--max-batch-tokens", type=int, default=16384, help="prompt + response tokens per trainer batch")
    r.add_argument("--no-top1", action="store_true", help="skip the trainer's top-1 pass (no greedy flips)")
    r.add_argument("--skip-bad", action="store_true", help="report bad rows and rescore the rest")
    r.add_argument("--expect-exact", action="store_true", help="exit 1 when any logprob differs")
    a = tsub.add_parser(
        "attribute",
        help="the mismatch each op family's fast kernel causes in our engine",
        description="Run our engine with the fast kernel of one op family at a time, rescore with the invariant "
        "trainer, and report each family's share of the mismatch (attribution.json and .png under --out).",
        formatter_class=fmt,
    )
    a.add_argument("--model", default=None, help="HF checkpoint dir; unset: the tiny Qwen3")
    a.add_argument(
        "--mode",
        default="engine",
        choices=("engine", "trainer"),
        help="engine: re-generate with each backend; trainer: score one set of invariant rollouts with each",
    )
    a.add_argument("--prompts", type=int, default=16, help="number of random token-id prompts")
    a.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    a.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    a.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    a.add_argument("--ops", default=None, help="comma-separated op families; unset: every family the model runs")
    a.add_argument("--seed", type=int, default=0, help="the prompts' and the sampling's seed")
    a.add_argument("--out", default="outputs/tim_attribution", help="output directory (attribution.json, .png)")
    a.add_argument("--device", default=None, help="cpu or cuda; unset: cuda when available")
    a.add_argument("--dtype", default=None, help="bfloat16, float16 or float32; unset: the checkpoint's")


def main(args: argparse.Namespace) -> int:
    if args.tim_command == "rescore":
        return run_rescore(args)
    return run_attribute(args)


def _check_dtype(name: str | None) -> str | None:
    if name is not None and name not in DTYPES:
        raise UsageError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return name


def _load(model: str | None, device: str, dtype: str | None):
    from vexact_models import default_checkpoint, load_model, parse_dtype

    path = Path(model) if model else default_checkpoint()
    m = load_model(path, dtype=parse_dtype(dtype) if dtype else None).to(device)
    return path, m.eval()


def _print_summary(s: dict, file=sys.stdout) -> None:
    ad = s["abs_delta"]
    print(
        f"sequences {s['sequences']}  tokens {s['tokens']}  differ {s['tokens_differ']} ({s['fraction_differ']:.4%})\n"
        f"|delta logprob| mean {ad['mean']:.3e}  p99 {ad['p99']:.3e}  max {ad['max']:.3e}\n"
        f"KL k1 {s['k1_kl']:.3e}  K3 {s['k3_kl']:.3e}  chi2 {s['chi2']:.3e}  log-ppl diff {s['log_ppl_diff']:.3e}\n"
        + _greedy_line(s.get("greedy", {})),
        file=file,
    )


def _greedy_line(g: dict) -> str:
    """The greedy-flip line: a count where the rollouts tell the engine's top-1, else why there is none."""
    if not g.get("available"):
        return f"greedy flips: not computed ({g.get('reason', 'no trainer top-1')})"
    top1 = f"trainer top-1 is the sampled token: {g['trainer_top1_is_sampled']:.4f}"
    if g.get("flips") is None:
        return f"greedy flips: not available ({g.get('reason', 'no engine top-1')}); {top1}"
    return f"greedy flips: {g['flips']} ({g['flip_rate']:.4%} of tokens); {top1}"


def run_rescore(args: argparse.Namespace) -> int:
    from vexact_trainer import Actor, BadRolloutError, compare, load_rollouts, rescore, write_report

    rollouts_file = check_file(args.rollouts, "rollouts")
    check_positive(args, "max_batch_tokens")
    device, model_dir, dtype = check_device(args.device), check_model(args.model), _check_dtype(args.dtype)
    path, model = _load(model_dir, device, dtype)
    try:
        rollouts, errors = load_rollouts(
            rollouts_file,
            args.layout,
            args.temperature,
            model.config.vocab_size,
            args.skip_bad,
            args.vllm_logprobs_mode,
        )
    except BadRolloutError as e:
        print(f"vexact tim: bad rollout: {e} (--skip-bad reports it and rescores the rest)", file=sys.stderr)
        return 2
    for e in errors:
        print(f"skipped: {e}", file=sys.stderr)
    if not rollouts:
        print("vexact tim: no rollout left to rescore", file=sys.stderr)
        return 2
    rescored = rescore(Actor(model), rollouts, args.max_batch_tokens, with_top1=not args.no_top1)
    summary = compare(rollouts, rescored)
    summary["input"] = {"file": str(args.rollouts), "model": str(path), "device": device, "skipped_rows": errors}
    report = write_report(summary, args.out, rollouts, rescored, title=Path(args.rollouts).name)
    _print_summary(summary)
    print(f"report: {report.files['html']}")
    if args.expect_exact and not summary["exact"]:
        print(f"--expect-exact: {summary['tokens_differ']} token logprobs differ", file=sys.stderr)
        return 1
    return 0


def attribute(
    model_path: Path,
    families: list[str],
    mode: str = "engine",
    prompts: int = 16,
    prompt_len: int = 16,
    max_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
) -> list[dict]:
    """One row per backend spec (``invariant``, ``fast:<family>`` each, ``fast``): the mismatch of our engine on
    that backend (``mode="engine"``), or of the trainer on it scoring the invariant engine's rollouts
    (``mode="trainer"``), against the invariant trainer. See the module docstring."""
    from vexact_engine import LLM, SamplingParams
    from vexact_models import load_model, parse_dtype
    from vexact_trainer import Actor, ActorConfig, compare, rescore, rollouts_from_outputs

    model = load_model(model_path, dtype=parse_dtype(dtype) if dtype else None).to(device).eval()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed * 1_000_003 + i)
        for i in range(prompts)
    ]
    specs = ["invariant"] + [f"fast:{f}" for f in families] + ["fast"]

    def generate(backend: str):
        kw = dict(max_num_seqs=prompts, max_num_batched_tokens=max(256, prompts), device=device, enforce_eager=True)
        llm = LLM(model_path, backend=backend, dtype=dtype, **kw)
        outs = llm.generate(prompt_ids, params, use_tqdm=False)
        del llm  # one engine (and its KV cache) at a time
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return rollouts_from_outputs(outs, temperature)

    rows = []
    invariant = Actor(model)
    if mode == "trainer":
        base = generate("invariant")
        base_scored = rescore(invariant, base, with_top1=False, progress=False)
    for spec in specs:
        if mode == "engine":
            rollouts = generate(spec)
            scored = rescore(invariant, rollouts, with_top1=False, progress=False)
        else:
            # the trainer on ``spec`` plays the engine, the invariant trainer the trainer, on the same tokens
            fast = rescore(Actor(model, ActorConfig(backend=spec)), base, with_top1=False, progress=False)
            rollouts = [replace(r, logprobs=lp) for r, lp in zip(base, fast.logprobs, strict=True)]
            scored = base_scored
        s = compare(rollouts, scored, worst=0)
        rows.append(
            {
                "backend": spec,
                "family": spec.partition(":")[2] or ("all" if spec == "fast" else "none"),
                "tokens": s["tokens"],
                "tokens_differ": s["tokens_differ"],
                "fraction_differ": s["fraction_differ"],
                "mean_abs_delta": s["abs_delta"]["mean"],
                "max_abs_delta": s["abs_delta"]["max"],
                "k3_kl": s["k3_kl"],
                "k1_kl": s["k1_kl"],
            }
        )
    total = sum(r["k3_kl"] for r in rows if r["backend"].startswith("fast:"))
    for r in rows:
        r["share_of_k3"] = (r["k3_kl"] / total if total > 0 else 0.0) if r["backend"].startswith("fast:") else None
    return rows


def default_families(config) -> list[str]:
    """The op families a model of ``config`` runs: every one of ``vk.OPS``, ``moe`` only with routed experts."""
    import vexact_kernels as vk

    has_experts = bool(getattr(config, "num_experts", 0))  # Qwen3-MoE; DeepSeek-V3 aliases n_routed_experts
    return [f for f in vk.OPS if f != "moe" or has_experts]


def run_attribute(args: argparse.Namespace) -> int:
    import vexact_kernels as vk
    from vexact_models import default_checkpoint, load_config

    device, model_dir, dtype = check_device(args.device), check_model(args.model), _check_dtype(args.dtype)
    path = model_dir or default_checkpoint()
    families = args.ops.split(",") if args.ops else default_families(load_config(path))
    bad = [f for f in families if f not in vk.OPS]
    if bad:
        raise UsageError(f"--ops {args.ops!r}: {', '.join(map(repr, bad))} not an op family; expected of {vk.OPS}")
    check_positive(args, "prompts", "prompt_len", "max_tokens")
    if not args.temperature > 0:
        raise UsageError(f"--temperature {args.temperature}: must be > 0")
    rows = attribute(
        path, families, args.mode, args.prompts, args.prompt_len, args.max_tokens, args.temperature, args.seed, device,
        dtype,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": str(path), "mode": args.mode, "device": device, "rows": rows}
    (out / "attribution.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'backend':<22} {'tokens':>7} {'differ':>8} {'mean|d|':>10} {'K3':>10} {'share':>7}")
    for r in rows:
        share = f"{r['share_of_k3']:.1%}" if r["share_of_k3"] is not None else ""
        print(
            f"{r['backend']:<22} {r['tokens']:>7} {r['fraction_differ']:>8.2%} {r['mean_abs_delta']:>10.2e} "
            f"{r['k3_kl']:>10.2e} {share:>7}"
        )
    _attribution_plot(rows, out)
    print(f"written: {out / 'attribution.json'}")
    return 0


def _attribution_plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no attribution.png")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["family"] for r in rows], [max(r["k3_kl"], 0.0) for r in rows], color="tab:red")
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_ylabel("K3 KL(engine || invariant trainer)")
    ax.set_title("fast kernel of one op family at a time")
    fig.tight_layout()
    fig.savefig(out / "attribution.png", dpi=90)
    plt.close(fig)
