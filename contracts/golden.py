"""Golden logprob fixtures, one set per target: what the engine and trainer produced for a fixed checkpoint,
prompts and seeds, stored with the sha256 of the tensors and the package versions that made them.

One fixture per committed tiny checkpoint (vexact_models' ``TINY_CHECKPOINTS``): one per model family (``qwen3``,
``qwen3_moe``, ``qwen2``, ``llama``, ``mistral``, ``deepseek_v3``, ``gpt_oss``; not on a GPU target that
``harness.GPU_NOT_YET`` names for the family), then the variants whose shapes make
more of the promised orders change bits (``TINY_VARIANTS``: MoE routing top-4 with and without ``norm_topk_prob``,
DeepSeek-V3 grouped top-6 with a shared expert, Qwen3 with heads of 64), under ``fixtures/<target>/<name>/``; on a GPU
target with an attention implementation other than the default ``triton`` (``$VEXACT_ATTENTION``, see
vexact_kernels.set_attention_impl) under ``fixtures/<target>-<impl>/<name>/``, since the implementations give
different bits. A checkpoint that implementation does not take (FA4: MLA's head sizes, heads under 32; of the committed
ones FA4 takes only ``qwen3_hd64``) runs the Triton kernels under it, and uses the Triton fixtures.

Record (after a deliberate numerics change, together with a version bump):
    python -m contracts.golden --target cpu            # every checkpoint
    python -m contracts.golden --target h100 --family qwen3_moe
    VEXACT_ATTENTION=fa4 python -m contracts.golden --target h100 --family qwen3_hd64   # -> fixtures/h100-fa4/
    FAMILIES="qwen3_moe_top4 qwen3_hd64" bash scripts/checks/gpu_checks.sh h100 golden fa4-golden   # on the GPU machine
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import vexact_engine
import vexact_kernels
import vexact_models
import vexact_trainer
from contracts.harness import not_yet_reason
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_kernels.attention import fa4_takes
from vexact_models import TINY_CHECKPOINTS, default_checkpoint, load_config, load_model
from vexact_trainer import Actor

FIXTURES = Path(__file__).parent / "fixtures"
N_PROMPTS = 8
FAMILIES = TINY_CHECKPOINTS  # the fixtures' names: the model families' tiny checkpoints, then the variants


def versions() -> dict[str, str]:
    return {
        "vexact-kernels": vexact_kernels.__version__,
        "vexact-models": vexact_models.__version__,
        "vexact-engine": vexact_engine.__version__,
        "vexact-trainer": vexact_trainer.__version__,
    }


def attention_impl(target: str, family: str | None = None) -> str | None:
    """The attention implementation a target's fixtures are recorded with (None on cpu: the CPU reference): the one in
    force, except that under ``fa4`` a family whose tiny checkpoint FA4 does not take (``vexact_kernels.attention
    .fa4_takes``: MLA's head sizes, heads under 32) runs, and so is recorded with, the Triton kernels."""
    if target == "cpu":
        return None
    impl = vexact_kernels.get_attention_impl()
    if impl == "fa4" and family is not None and not fa4_takes(*_head_dims(family)):
        return "triton"
    return impl


def _head_dims(family: str) -> tuple[int, int]:
    """(qk, v) head sizes of the tiny checkpoint ``family`` (a family or a variant)."""
    cfg = load_config(default_checkpoint(family))
    if getattr(cfg, "kv_lora_rank", None):  # MLA
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return d, d


def fixture_dir(target: str, family: str) -> Path:
    impl = attention_impl(target, family)
    return FIXTURES / (target if impl in (None, "triton") else f"{target}-{impl}") / family


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """The fixed prompts and sampling parameters (greedy and sampled rows) of every fixture."""
    g = torch.Generator().manual_seed(1234)
    prompts = [
        torch.randint(0, 256, (int(torch.randint(3, 48, (1,), generator=g)),), generator=g).tolist()
        for _ in range(N_PROMPTS)
    ]
    params = [
        SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.2][i % 4], top_p=0.95, max_tokens=24, seed=100 + i, ignore_eos=True
        )
        for i in range(N_PROMPTS)
    ]
    return prompts, params


def _score_temperatures(params: list[SamplingParams]) -> list[float]:
    return [p.temperature if p.temperature > 0 else 1.0 for p in params]


def produce(device: str = "cpu", family: str = "qwen3") -> dict[str, torch.Tensor]:
    """Run the fixed workload: engine rollouts (sampled and greedy) and the trainer's rescoring."""
    model = load_model(default_checkpoint(family), device=device)
    prompts, params = workload()
    # a copy for the engine, which packs its weights (grouped projections); the trainer scores with its own
    engine_cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, device=device)
    llm = LLM(model=copy.deepcopy(model), config=engine_cfg)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scored = Actor(model).compute_log_probs(
        prompts, [o.token_ids for o in outs], _score_temperatures(params), with_entropy=True
    )
    return {
        "prompt_ids": torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        "token_ids": torch.tensor([t for o in outs for t in o.token_ids], dtype=torch.int64),
        "engine_logprobs": torch.cat([o.logprobs for o in outs]),
        "trainer_logprobs": torch.cat(scored.logprobs).cpu(),
        "trainer_entropy": torch.cat(scored.entropy).cpu(),
    }


def rescore(tensors: dict[str, torch.Tensor], device: str = "cpu", family: str = "qwen3") -> dict[str, torch.Tensor]:
    """The trainer's half of the workload alone: its logprobs and entropy of a fixture's recorded rollouts (one packed
    forward, no generation), which must reproduce the fixture's ``trainer_logprobs`` and ``trainer_entropy``. A quick
    form of the golden contract for what the trainer and the engine share (every op family but sampling)."""
    model = load_model(default_checkpoint(family), device=device)
    _, params = workload()
    cuts = torch.cumsum(tensors["prompt_lens"], 0).tolist()
    prompts = [p.tolist() for p in torch.tensor_split(tensors["prompt_ids"], cuts[:-1])]
    responses = [r.tolist() for r in torch.split(tensors["token_ids"], [p.max_tokens for p in params])]
    scored = Actor(model).compute_log_probs(prompts, responses, _score_temperatures(params), with_entropy=True)
    return {"trainer_logprobs": torch.cat(scored.logprobs).cpu(), "trainer_entropy": torch.cat(scored.entropy).cpu()}


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def record_command(target: str, family: str) -> str:
    impl = attention_impl(target, family)
    env = f"VEXACT_ATTENTION={impl} " if impl not in (None, "triton") else ""
    return f"{env}python -m contracts.golden --target {target} --family {family}"


def load(target: str, family: str = "qwen3") -> tuple[dict[str, torch.Tensor], dict]:
    d = fixture_dir(target, family)
    if not (d / "golden.json").is_file():
        raise FileNotFoundError(
            f"no golden fixture recorded for target {target!r}, family {family!r}, attention "
            f"{attention_impl(target, family) or 'cpu reference'} (looked in {d}): {record_command(target, family)}"
        )
    return load_file(str(d / "golden.safetensors")), json.loads((d / "golden.json").read_text())


def record(target: str, device: str, family: str = "qwen3") -> Path:
    tensors = produce(device, family)
    d = fixture_dir(target, family)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "golden.safetensors"))
    meta = {
        "target": target,
        "family": family,
        **({"attention": attention_impl(target, family)} if target != "cpu" else {}),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "sha256": tensors_sha256(tensors),
        "versions": versions(),
        "torch": torch.__version__,
        "recorded": datetime.date.today().isoformat(),
        "tokens": int(tensors["token_ids"].numel()),
    }
    (d / "golden.json").write_text(json.dumps(meta, indent=2) + "\n")
    return d


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="cpu", choices=["cpu", "h100", "h200", "b200"])
    ap.add_argument("--family", choices=FAMILIES, help="a tiny checkpoint (default: every one)")
    args = ap.parse_args()
    for family in [args.family] if args.family else FAMILIES:
        if reason := not_yet_reason(family, args.target):
            print(f"not recorded: {family} on {args.target}: {reason}")
            continue
        print(f"recorded {record(args.target, 'cpu' if args.target == 'cpu' else 'cuda', family)}")
