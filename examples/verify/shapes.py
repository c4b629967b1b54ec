"""The verify pair's named shapes: one table, expanded into the shell variables run_pair.sh runs with.

    PAIR=dense-1k bash examples/verify/run_pair.sh RESULTS_DIR        # run_pair.sh evaluates `shapes.py` itself
    python examples/verify/shapes.py dense-1k                         # what a pair expands to (KEY=value lines)

- ``smoke``: the small pair (128 sequences of 64 tokens, byte vocabulary of 272): a quick run of the whole path.
  ``SHAPE`` picks its widths: ``qwen3-1.7b`` (28 layers) or ``qwen3-30b-a3b`` (4 layers).
- ``dense-1k`` / ``dense-4k``: Qwen3-1.7B's shape (28 layers) with its real vocabulary (151,936), 64 prompts x n 8 =
  512 sequences a step, responses of 1024 / 4096 tokens (``ignore_eos``).
- ``dense8b-1k``: Qwen3-8B's shape (36 layers), 512 x 1024 tokens, FSDP over 2 GPUs (fp32 master weights, gradients
  and Adam states of 8B parameters are 128 GB: more than one GPU holds).
- ``moe-1k`` / ``moe-4k``: Qwen3-30B-A3B's widths at a depth of ``LAYERS`` (default 4), 512 x 1024 / 4096 tokens.
- ``gptoss-1k``: gpt-oss-20b's widths (sliding and full layers alternating, sinks, 32 biased experts top-4, bf16) at a
  depth of ``LAYERS`` (default 4), 512 x 1024 tokens, the byte vocabulary (272: ``make_model.py --vocab real`` is
  Qwen3's layout only).

Every pair but ``smoke`` is tuned as verl's example scripts tune a run (``examples/grpo_trainer/*seq_balance*.sh``,
``recipe/dapo/*.sh`` and docs/perf/perf_tuning.rst of verl): dynamic batch size with a token budget per GPU
(``use_dynamic_bsz``; ``ppo_max_token_len_per_gpu`` at least 2 x (prompt + response), and verl's default 16384 where
that is less; the forward-only ``log_prob_max_token_len_per_gpu`` at 2x that, as the guide allows), padding removed
and gradient checkpointing (verl 0.9.1's defaults, passed explicitly as its examples do), vLLM's scheduler at verl's
defaults (``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192, chunked prefill). Both arms get the same budgets:
the vexact actor is verl's FSDP engine with its micro-batching, so the same knobs size its micro-batches.

Environment that overrides a pair's value: ``SHAPE`` (smoke only), ``LAYERS``, ``STEPS``, ``GPU_MEM``, ``NGPUS``,
``PPO_MAX_TOKENS``, ``LOGPROB_MAX_TOKENS``.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import asdict, dataclass, replace

# verl 0.9.1's default per-GPU token budget (actor.ppo_max_token_len_per_gpu), the floor of the tuned budgets
VERL_DEFAULT_TOKENS = 16384
# vocabulary size by make_model.py --vocab
VOCAB_SIZES = {"byte": 272, "real": 151936}
SMOKE_SHAPES = {"qwen3-1.7b": (28, 0.4), "qwen3-30b-a3b": (4, 0.25)}  # SHAPE -> (layers, rollout's GPU memory share)


class ShapeError(ValueError):
    """A pair name or an override out of range; the message names the value and what is allowed."""


@dataclass(frozen=True)
class Pair:
    name: str
    shape: str  # make_model.py --shape: the real model whose widths the random checkpoint takes
    layers: int
    vocab: str  # make_model.py --vocab: "byte" (272 ids) or "real" (the model's own, full_vocab.py's tokenizer)
    train_batch_size: int  # prompts a step
    rollout_n: int
    ppo_mini_batch_size: int  # prompts an optimizer step
    max_prompt_length: int
    max_response_length: int
    steps: int
    gpu_memory_utilization: float  # the rollout's share of GPU memory; the actor's states stay on the GPU beside it
    tuned: bool  # verl's example tuning (dynamic batch size, token budgets) rather than smoke's fixed micro-batches
    ngpus: int = 1
    moe: bool = False
    ppo_max_token_len_per_gpu: int | None = None  # tuned pairs: set from the lengths unless given
    log_prob_max_token_len_per_gpu: int | None = None

    def __post_init__(self) -> None:
        if self.vocab not in VOCAB_SIZES:
            raise ShapeError(f"{self.name}: vocab {self.vocab!r}; allowed {sorted(VOCAB_SIZES)}")
        for key in ("layers", "train_batch_size", "rollout_n", "ppo_mini_batch_size", "max_prompt_length",
                    "max_response_length", "steps", "ngpus"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ShapeError(f"{self.name}: {key} is {getattr(self, key)}; must be >= 1")
        if not 0.0 < self.gpu_memory_utilization < 1.0:
            raise ShapeError(f"{self.name}: gpu_memory_utilization {self.gpu_memory_utilization}; allowed (0, 1)")
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ShapeError(f"{self.name}: ppo_mini_batch_size {self.ppo_mini_batch_size} does not divide "
                             f"train_batch_size {self.train_batch_size}")  # fmt: skip
        if self.tuned:
            seq = self.max_prompt_length + self.max_response_length
            actor = self.ppo_max_token_len_per_gpu or max(VERL_DEFAULT_TOKENS, 2 * seq)
            if actor < seq:  # verl packs whole sequences: a budget below one sequence cannot hold the longest
                raise ShapeError(f"{self.name}: ppo_max_token_len_per_gpu {actor} is below one sequence of {seq}")
            object.__setattr__(self, "ppo_max_token_len_per_gpu", actor)
            object.__setattr__(self, "log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu or 2 * actor)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZES[self.vocab]

    @property
    def context(self) -> int:
        """max_position_embeddings of the checkpoint: prompt + response, rounded up to a multiple of 1024."""
        return -(-(self.max_prompt_length + self.max_response_length) // 1024) * 1024

    @property
    def stem(self) -> str:
        """The result files' model field (``<tag>-<stem>-<arm>.jsonl``): smoke keeps its model's name."""
        return self.shape if self.name == "smoke" else self.name

    @property
    def sequences(self) -> int:
        return self.train_batch_size * self.rollout_n


_TUNED = dict(vocab="real", train_batch_size=64, rollout_n=8, ppo_mini_batch_size=16, max_prompt_length=128,
              tuned=True)  # fmt: skip
# gpt-fast's way: every pair in one table. GPU memory shares: the actor's fp32 weights, gradients and Adam states
# (16 bytes a parameter) stay on the GPU while vLLM generates, so one GPU gives the rollout less than verl's
# 8-GPU examples do (0.6, where FSDP shards the actor 8 ways)
PAIRS = {
    "smoke": Pair("smoke", "qwen3-1.7b", 28, "byte", 32, 4, 32, 128, 64, steps=10, gpu_memory_utilization=0.4,
                  tuned=False),
    "dense-1k": Pair("dense-1k", "qwen3-1.7b", 28, **_TUNED, max_response_length=1024, steps=6,
                     gpu_memory_utilization=0.4),
    "dense-4k": Pair("dense-4k", "qwen3-1.7b", 28, **_TUNED, max_response_length=4096, steps=4,
                     gpu_memory_utilization=0.4),
    "dense8b-1k": Pair("dense8b-1k", "qwen3-8b", 36, **_TUNED, max_response_length=1024, steps=4,
                       gpu_memory_utilization=0.35, ngpus=2),
    "moe-1k": Pair("moe-1k", "qwen3-30b-a3b", 4, **_TUNED, max_response_length=1024, steps=4,
                   gpu_memory_utilization=0.25, moe=True),
    "moe-4k": Pair("moe-4k", "qwen3-30b-a3b", 4, **_TUNED, max_response_length=4096, steps=4,
                   gpu_memory_utilization=0.25, moe=True),
    "gptoss-1k": Pair("gptoss-1k", "gpt-oss-20b", 4, **{**_TUNED, "vocab": "byte"}, max_response_length=1024,
                      steps=4, gpu_memory_utilization=0.25, moe=True),
}  # fmt: skip

# environment variable -> (Pair field, type)
ENV = {"LAYERS": ("layers", int), "STEPS": ("steps", int), "GPU_MEM": ("gpu_memory_utilization", float),
       "NGPUS": ("ngpus", int), "PPO_MAX_TOKENS": ("ppo_max_token_len_per_gpu", int),
       "LOGPROB_MAX_TOKENS": ("log_prob_max_token_len_per_gpu", int)}  # fmt: skip


def expand(name: str, env: dict[str, str] | None = None) -> Pair:
    """The pair ``name`` with the overrides of ``env`` (``os.environ`` by default) applied and validated."""
    env = os.environ if env is None else env
    if name not in PAIRS:
        raise ShapeError(f"PAIR must be one of {', '.join(PAIRS)}; got {name!r}")
    pair = PAIRS[name]
    shape = env.get("SHAPE") or None
    if name == "smoke":
        shape = shape or pair.shape
        if shape not in SMOKE_SHAPES:
            raise ShapeError(f"SHAPE must be {' or '.join(SMOKE_SHAPES)}, got {shape!r}")
        layers, gpu_mem = SMOKE_SHAPES[shape]
        pair = replace(pair, shape=shape, layers=layers, gpu_memory_utilization=gpu_mem, moe="30b-a3b" in shape)
    elif shape is not None and shape != pair.shape:
        raise ShapeError(f"SHAPE={shape} with PAIR={name}: the pair's model is {pair.shape} (SHAPE is for smoke)")
    changes = {}
    for var, (field, kind) in ENV.items():
        if env.get(var):
            try:
                changes[field] = kind(env[var])
            except ValueError:
                raise ShapeError(f"{var}={env[var]!r}: expected {kind.__name__}") from None
    if changes.get("ppo_max_token_len_per_gpu") and "log_prob_max_token_len_per_gpu" not in changes:
        changes["log_prob_max_token_len_per_gpu"] = None  # follows the actor's budget again
    if changes and not pair.tuned:
        changes = {k: v for k, v in changes.items() if "token_len" not in k}  # smoke uses fixed micro-batches
    return replace(pair, **changes) if changes else pair


def shell(pair: Pair) -> str:
    """``KEY=value`` lines (shell-quoted) for run_pair.sh to evaluate: the pair's fields upper-cased plus the
    derived VOCAB_SIZE, CONTEXT, STEM and SEQUENCES; booleans as 0/1, unset budgets empty."""
    values = {**asdict(pair), "vocab_size": pair.vocab_size, "context": pair.context, "stem": pair.stem,
              "sequences": pair.sequences}  # fmt: skip
    lines = []
    for key, v in values.items():
        v = "" if v is None else int(v) if isinstance(v, bool) else v
        lines.append(f"PAIR_{key.upper()}={shlex.quote(str(v))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: shapes.py PAIR  (PAIR in {', '.join(PAIRS)})", file=sys.stderr)
        return 2
    try:
        print(shell(expand(argv[0])))
    except ShapeError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
