"""Write ``<name>.meta.json`` beside one arm's JSONL (called by run_pair.sh after each arm, from its environment).

The meta holds what compare.py checks before it compares arms (``config``: the settings every arm must share), what
benchmarks/rl_step.py reports beside the times (``stack``, ``gpu``, ``peak_gpu_mem_mib``) and how the run was made
(``date``, ``commit``, ``command``). Peak memory is the largest ``nvidia-smi`` sample of the arm's run (the whole
device: trainer, rollout and their processes), since verl's own figure sees the trainer's allocator only.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # the monorepo's packages may run from their sources (PYTHONPATH)
        if dist.startswith("vexact-"):
            try:
                return __import__(dist.replace("-", "_")).__version__
            except ImportError:
                return None
        return None


def _gpu() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def _commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _peak_mib(path: Path) -> int | None:
    if not path.exists():
        return None
    samples = [int(x) for x in path.read_text().split() if x.strip().isdigit()]
    return max(samples) if samples else None


# meta config key -> the verl override it is read from
SHARED = {
    "steps": "trainer.total_training_steps",
    "lr": "actor_rollout_ref.actor.optim.lr",
    "train_batch_size": "data.train_batch_size",
    "rollout_n": "actor_rollout_ref.rollout.n",
    "ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "ppo_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "ignore_eos": "actor_rollout_ref.rollout.ignore_eos",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
}


def _value(text: str) -> bool | int | float | str:
    """A Hydra override's value as JSON would hold it (True -> true, 32 -> 32, 3e-6 -> 3e-06)."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    env = os.environ
    results, name = Path(env["RESULTS"]), env["NAME"]
    moe = env["MOE"] == "1"
    # the shared settings as the arm's command passed them to verl (one source: run_pair.sh's overrides)
    overrides = dict(w.split("=", 1) for w in shlex.split(env["CMDLINE"]) if "=" in w and not w.startswith("+"))
    config = {
        "shape": env["SHAPE"],
        "layers": int(env["LAYERS"]),
        "weights": "random (examples/verl_grpo/make_model.py --seed 0)",
        "data": "examples/verl_grpo/make_dataset.py (arithmetic), data.seed " + overrides["data.seed"],
        "reward": overrides["reward.custom_reward_function.path"],
        **{key: _value(overrides[override]) for key, override in SHARED.items()},
    }
    stack = {
        "rollout": "vllm" if env["ARM"] == "vllm" else "vexact",
        "actor": env["ACTOR"],
        "attention": env["ATTN"],
        "moe": ("VeOmni fused_triton" if env["ARM"] == "vllm" else "vexact fused MoE") if moe else None,
        "versions": {
            d: _version(d)
            for d in ("verl", "vllm", "ray", "torch", "transformers", "veomni", "vexact-kernels", "vexact-verl")
        },
    }
    if env["ARM"] != "vllm":
        stack["rollout_backend"] = "fast" if env["ARM"] == "fast" else "invariant"
    log = results / f"{name}.jsonl"
    steps = sum(1 for line in log.open() if line.strip()) if log.exists() else 0
    meta = {
        "arm": env["ARM"],
        "model": f"{env['SHAPE']}-l{env['LAYERS']}",
        "gpu": _gpu(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "command": env["CMDLINE"],
        "config": config,
        "stack": stack,
        "peak_gpu_mem_mib": _peak_mib(results / f"{name}.mem"),
        "exit_code": int(env["RC"]),
        "steps_logged": steps,
    }
    (results / f"{name}.meta.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
