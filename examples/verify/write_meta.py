"""Write ``<name>.meta.json`` beside one arm's JSONL (called by run_pair.sh as each arm starts and when it ends, from
its environment: written first with ``exit_code`` null, so an arm stopped early keeps a meta compare.py can check).

The meta holds what compare.py checks before it compares arms (``config``: the settings every arm must share, the
shape first, each as the run had it: the arm's override, else verl's default), what benchmarks/rl_step.py reports
beside the times (``stack``, with the actor's ``attention`` and ``attention_why``; ``gpu``, ``peak_gpu_mem_mib``),
how the run was made (``date``, ``commit``, ``command``) and ``differs_from_verl_defaults``: every setting of the
arm's command whose value is not verl's default (``{key: {"value": ..., "verl_default": ...}}``; ``verl_default``
null where verl's config has no such key), read against verl's own reference config
(``verl/trainer/config/_generated_ppo_*trainer.yaml`` of the verl the arm ran, with the config groups
``ppo_trainer.yaml`` picks by default, e.g. ``model_engine: dp``).
Peak memory is the largest ``nvidia-smi`` sample of the arm's run (any one of its GPUs: trainer, rollout and their
processes), since verl's own figure sees the trainer's allocator only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any


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
    """``$COMMIT`` or ``$VEXACT_COMMIT`` where set (a copy of the tree without its git directory, as the
    benchmarks take it), else git's short HEAD."""
    for key in ("COMMIT", "VEXACT_COMMIT"):
        if os.environ.get(key):
            return os.environ[key]
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


# meta config key -> the verl setting it is read from, shape first: compare.py names the first that differs
SHAPE = {
    "train_batch_size": "data.train_batch_size",
    "rollout_n": "actor_rollout_ref.rollout.n",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "ignore_eos": "actor_rollout_ref.rollout.ignore_eos",
    "ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "n_gpus": "trainer.n_gpus_per_node",
    "steps": "trainer.total_training_steps",
    "lr": "actor_rollout_ref.actor.optim.lr",
}
# the tuning both arms share (token budgets, micro-batches, padding, checkpointing, the rollout's memory and scheduler)
TUNING = {
    "use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "ppo_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "log_prob_use_dynamic_bsz": "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "log_prob_max_token_len_per_gpu": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "ppo_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "enable_gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
    "max_num_batched_tokens": "actor_rollout_ref.rollout.max_num_batched_tokens",
}
_ABSENT = object()


def _value(text: str) -> bool | int | float | str | list:
    """A Hydra override's value as JSON would hold it (True -> true, 32 -> 32, 3e-6 -> 3e-06, [console,file] -> a
    list: the command line as run_pair.sh records it, its quotes gone)."""
    if text.startswith("[") and text.endswith("]"):
        return [_value(x.strip().strip("'\"")) for x in text[1:-1].split(",") if x.strip()]
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def overrides(cmdline: str) -> dict[str, bool | int | float | str]:
    """The ``key=value`` words of a verl command (``+key`` as ``key``), values parsed; Hydra's own (``hydra.*``) left
    out."""
    out = {}
    for word in shlex.split(cmdline):
        if "=" in word and not word.startswith("-"):
            key, text = word.split("=", 1)
            key = key.lstrip("+")
            if not key.startswith("hydra."):
                out[key] = _value(text)
    return out


def verl_defaults(model_engine: str = "dp"):
    """verl's reference config for ``model_engine`` (dp: FSDP; veomni) as an OmegaConf object, or None where verl is
    not installed. Read from the YAML beside verl's trainer, without importing verl (slow, and it needs a GPU stack)."""
    from omegaconf import OmegaConf

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"
    name = "_generated_ppo_veomni_trainer.yaml" if model_engine == "veomni" else "_generated_ppo_trainer.yaml"
    if not (folder / name).is_file():
        return None
    cfg = OmegaConf.load(folder / name)
    # the config groups ppo_trainer.yaml's defaults list picks (model_engine: dp) are no keys of the generated YAML
    main = folder / "ppo_trainer.yaml"
    for entry in OmegaConf.to_container(OmegaConf.load(main)).get("defaults", []) if main.is_file() else []:
        if isinstance(entry, dict) and len(entry) == 1:
            group, choice = next(iter(entry.items()))
            if "@" not in group and "/" not in group and isinstance(choice, str) and group not in cfg:
                OmegaConf.update(cfg, group, choice, force_add=True)
    return cfg


def _select(cfg, key: str) -> Any:
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key, default=_ABSENT)
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


VEOMNI_MOE = "actor_rollout_ref.actor.veomni.moe_implementation"


def settings(cmdline: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]] | None]:
    """The arm's effective settings (its overrides applied to verl's defaults: ``key -> value``, a key verl lacks
    absent) and the overrides that differ from verl's defaults (None where verl's config cannot be read)."""
    from omegaconf import OmegaConf

    ov = overrides(cmdline)
    defaults = verl_defaults(str(ov.get("model_engine", "dp")))
    if defaults is None:
        return dict(ov), None
    differs = {}
    for key, value in ov.items():
        default = _select(defaults, key)
        if default is _ABSENT or value != default:
            differs[key] = {"value": value, "verl_default": None if default is _ABSENT else default}
    effective = defaults.copy()
    for key, value in ov.items():
        OmegaConf.update(effective, key, value, force_add=True)
    resolved = {key: _select(effective, key) for key in {**SHAPE, **TUNING}.values()}
    return {k: v for k, v in resolved.items() if v is not _ABSENT}, differs


def main() -> None:
    env = os.environ
    results, name = Path(env["RESULTS"]), env["NAME"]
    moe = env["MOE"] == "1"
    pair = env.get("PAIR", "smoke")
    # the shared settings as the arm ran them (one source: run_pair.sh's overrides, over verl's defaults)
    ov = overrides(env["CMDLINE"])
    effective, differs = settings(env["CMDLINE"])
    config = {
        "shape": env["SHAPE"],
        "layers": int(env["LAYERS"]),
        "vocab_size": int(env["VOCAB_SIZE"]) if env.get("VOCAB_SIZE") else None,
        **{key: effective.get(setting) for key, setting in SHAPE.items()},
        "weights": "random (examples/verl_grpo/make_model.py --seed 0)",
        "data": f"examples/verl_grpo/make_dataset.py (arithmetic), data.seed {ov['data.seed']}",
        "reward": ov["reward.custom_reward_function.path"],
        **{key: effective.get(setting) for key, setting in TUNING.items()},
        "pair": pair,  # a label: the settings above say how pairs differ
    }
    stack = {
        "rollout": "vllm" if env["ARM"] == "vllm" else "vexact",
        "actor": env["ACTOR"],
        "attention": env["ATTN"],
        "attention_why": env.get("ATTN_WHY"),  # run_pair.sh: why this attention (FA4, or why not)
        # the vllm arm's VeOmni MoE kernel as its command sets it (fused_triton; eager for gpt-oss)
        "moe": (f"VeOmni {ov.get(VEOMNI_MOE)}" if env["ARM"] == "vllm" else "vexact fused MoE") if moe else None,
        "versions": {
            d: _version(d)
            for d in ("verl", "vllm", "ray", "torch", "transformers", "veomni", "vexact-kernels", "vexact-verl")
        },
    }
    # VLLM_LOGGING_LEVEL: run_pair.sh's GEN_STATS=1 sets INFO on the vllm arm, for vLLM's stats lines in its log
    stack["env"] = {k: env[k] for k in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_LOGGING_LEVEL") if k in env}
    if env["ARM"] != "vllm":
        stack["rollout_backend"] = "fast" if env["ARM"] == "fast" else "invariant"
    log = results / f"{name}.jsonl"
    steps = sum(1 for line in log.open() if line.strip()) if log.exists() else 0
    meta = {
        "arm": env["ARM"],
        "model": f"{env['SHAPE'] if pair == 'smoke' else pair}-l{env['LAYERS']}",
        "gpu": _gpu(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "command": env["CMDLINE"],
        "config": config,
        "stack": stack,
        "differs_from_verl_defaults": differs,
        "peak_gpu_mem_mib": _peak_mib(results / f"{name}.mem"),
        "exit_code": int(env["RC"]) if env.get("RC") else None,  # None: written as the run started; it has not ended
        "steps_logged": steps,
    }
    (results / f"{name}.meta.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
