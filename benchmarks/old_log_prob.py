"""verl's ``timing_s/old_log_prob`` on CPU, phase by phase, for the vexact actor engine and verl's own FSDP engine.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/old_log_prob.py --seqs 512 --response 1024

Drives the path of one ``old_log_prob`` in verl 0.9.1's synchronous trainer on a world-size-1 gloo group with a CPU
platform, the engines built for real (``vexact_verl.engine_builder.build_actor_engine``, as the tests build them) on
a tiny Qwen3 checkpoint: the driver's ``RayPPOTrainer._compute_old_log_prob`` (DataProto to TensorDict,
``left_right_2_no_padding``), the batch shipped to the worker (a pickle round trip, as Ray's object store), the
worker's ``TrainingWorker.infer_batch`` (the engine's ``infer_batch``: micro-batches, ``forward_step``,
``postprocess_batch_func``; ``_postprocess_output``, ``.cpu()``), the output shipped back and concatenated
(``concat_tensordict``), then the rest of the driver's timer: ``no_padding_2_padding`` of log-probs and entropy,
``agg_loss`` of the entropy, ``DataProto.union`` and ``calculate_debug_metrics`` (with the vexact TIM summary
installed). Each phase is timed by ``time.perf_counter`` and printed per token; the forwards (the engine's
``forward_step``) are timed apart, so "outside the forward" is the rest.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ENGINES = ("vexact", "fsdp")


def tiny_checkpoint(path: Path, vocab: int, max_len: int) -> Path:
    """A one-layer, 32-wide Qwen3 with ``vocab`` tokens: a forward cheap enough that verl's path around it shows."""
    from vexact_models.tiny import make_tiny_checkpoint, tiny_qwen3_config

    cfg = tiny_qwen3_config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=0,
    )  # fmt: skip
    return make_tiny_checkpoint(path, cfg, tokenizer=False)


def setup_cpu_verl() -> None:
    """verl on this process's CPU: a CPU platform in verl's platform slot, a world-size-1 gloo group, the vexact
    engines registered (what the tests' ``verl_device`` fixture does for a test)."""
    from verl.plugin.platform import platform_manager

    from vexact_trainer import init_distributed
    from vexact_verl.cpu_platform import CPUPlatform
    from vexact_verl.registration import register_engine

    platform_manager._current_platform = CPUPlatform()
    torch.cpu.set_rng_state = torch.set_rng_state
    # TrainingWorker logs the device's peak memory; torch.cpu keeps none
    torch.cpu.max_memory_allocated = torch.cpu.max_memory_reserved = lambda *a: 0
    init_distributed("cpu")
    register_engine()


def rollout_batch(seqs: int, max_prompt: int, response: int, vocab: int, seed: int = 0):
    """verl's batch after generation, as the trainer holds it at ``old_log_prob``: left-padded prompts (1 to
    ``max_prompt`` tokens), right-padded responses (``response`` tokens each, the budget used up as in a long-CoT
    run), the rollout's log-probs, and the non-tensor columns verl's agent loop adds."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(max_prompt // 2, max_prompt + 1, (seqs,), generator=g)
    prompts = torch.zeros(seqs, max_prompt, dtype=torch.long)
    attention = torch.zeros(seqs, max_prompt + response, dtype=torch.long)
    for i, p in enumerate(plens.tolist()):
        prompts[i, max_prompt - p :] = torch.randint(2, vocab, (p,), generator=g)
        attention[i, max_prompt - p :] = 1
    responses = torch.randint(2, vocab, (seqs, response), generator=g)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": attention[:, max_prompt:].clone(),
        "rollout_log_probs": -torch.rand(seqs, response, generator=g),
    }

    def column(make):
        out = np.empty(seqs, dtype=object)
        out[:] = [make(i) for i in range(seqs)]
        return out

    # the dataset's columns and the agent loop's (verl 0.9.1: its extra_fields keys, each a column of its own)
    non_tensor = {
        "uid": column(lambda i: f"uid-{i // 8}"),
        "data_source": column(lambda i: "arith"),
        "index": column(lambda i: i // 8),
        "raw_prompt": column(lambda i: [{"role": "user", "content": f"What is {i} + {i}?"}]),
        "reward_model": column(lambda i: {"ground_truth": str(2 * i), "style": "rule"}),
        "extra_info": column(lambda i: {"index": i // 8, "split": "train"}),
        "__num_turns__": np.full(seqs, 2, dtype=np.int32),
        "turn_scores": column(lambda i: []),
        "tool_rewards": column(lambda i: []),
        "min_global_steps": column(lambda i: 1),
        "max_global_steps": column(lambda i: 1),
        "global_steps": column(lambda i: 1),
        "extras": column(lambda i: None),
    }
    meta = {"global_token_num": attention.sum(-1).tolist(), "temperature": 1.0}
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor, meta_info=meta)


PHASES = ("driver_in", "ship_in", "worker", "forward", "ship_out", "driver_out", "debug_metrics")


class Clock:
    """Seconds per phase (:data:`PHASES`), summed over repeats; ``forward`` is a part of ``worker``."""

    def __init__(self):
        self.s: dict[str, float] = defaultdict(float)

    def total(self) -> float:
        return sum(v for k, v in self.s.items() if k != "forward")

    def outside_forward(self) -> float:
        return self.total() - self.s["forward"]

    def phase(self, name: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                clock.s[name] += time.perf_counter() - self.t

        return _Phase()


def ship(obj):
    """A Ray object-store hop: serialised and read back in the other process."""
    return pickle.loads(pickle.dumps(obj, protocol=5))


def time_forwards(engine, clock: Clock) -> None:
    """Time the engine's ``forward_step`` calls (the model forward and its log-probs) as phase ``forward``."""
    original = engine.forward_step

    @functools.wraps(original)
    def forward_step(*args, **kwargs):
        with clock.phase("forward"):
            return original(*args, **kwargs)

    engine.forward_step = forward_step


def old_log_prob(engine, batch, clock: Clock, worker) -> dict:
    """One ``old_log_prob`` of verl's ``RayPPOTrainer.fit``, phase by phase (the code of verl 0.9.1's
    ``_compute_old_log_prob``, the worker's ``compute_log_prob`` and the lines of the trainer's timer after it)."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.utils.debug.metrics import calculate_debug_metrics
    from verl.utils.tensordict_utils import concat_tensordict
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    with clock.phase("driver_in"):
        batch_td = batch.to_tensordict()
        batch_td = left_right_2_no_padding(batch_td)
        tu.assign_non_tensor(batch_td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    with clock.phase("ship_in"):
        data = ship(batch_td)
    with clock.phase("worker"):
        output = TrainingWorker.infer_batch(worker, data)
        output = output.cpu()
    with clock.phase("ship_out"):
        output = concat_tensordict([ship(output)])
    with clock.phase("driver_out"):
        entropy = tu.get(output, "entropy")
        log_probs = tu.get(output, "log_probs")
        entropy = no_padding_2_padding(entropy, batch_td)
        log_probs = no_padding_2_padding(log_probs, batch_td)
        result = tu.get_tensordict({"old_log_probs": log_probs.float(), "entropys": entropy.float()})
        result = DataProto.from_tensordict(result)
        entropy_agg = agg_loss(
            loss_mat=result.batch["entropys"], loss_mask=batch.batch["response_mask"], loss_agg_mode="token-mean"
        )
        metrics = {"actor/entropy": entropy_agg.item()}
        result.batch.pop("entropys")
        merged = batch.union(result)
    with clock.phase("debug_metrics"):
        metrics.update(calculate_debug_metrics(merged))
    return {"log_probs": log_probs, "metrics": metrics, "output": output}


def fake_worker(engine):
    """What ``TrainingWorker.infer_batch`` reads of its worker (built by Ray in verl): the engine and its configs."""
    worker = SimpleNamespace(
        engine=engine,
        model_config=engine.model_config,
        engine_config=engine.engine_config,
        loss_fn=None,
        flops_counter=None,
        device_name="cpu",
    )
    from verl.workers.engine_workers import TrainingWorker

    worker._postprocess_output = functools.partial(TrainingWorker._postprocess_output, worker)
    return worker


def run(kind: str, args, path: Path) -> Clock:
    """``args.repeats`` old_log_prob passes of engine ``kind`` after a small warm-up one, timed. The engine is the
    actor (fp32 master weights, bf16 compute) with verl's dynamic batch size; ``fsdp`` is verl's FSDP2 engine."""
    from vexact_verl.engine_builder import build_actor_engine

    strategy = "vexact" if kind == "vexact" else "fsdp2"
    engine = build_actor_engine(
        strategy, path=path, use_dynamic_bsz=True, infer_max_token_len_per_gpu=args.max_token_len
    )
    worker = fake_worker(engine)
    batch = rollout_batch(args.seqs, args.prompt, args.response, args.vocab)
    old_log_prob(engine, rollout_batch(8, args.prompt, 16, args.vocab), Clock(), worker)  # warm-up
    clock = Clock()
    time_forwards(engine, clock)
    for _ in range(args.repeats):
        old_log_prob(engine, batch, clock, worker)
    return clock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: vexact, fsdp")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128, help="longest prompt (prompts hold half of it to all of it)")
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512, help="151936 is Qwen3's (the CPU reference's forward is slow)")
    p.add_argument("--max-token-len", type=int, default=16384, help="infer_max_token_len_per_gpu")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable figures on a shared host)")
    p.add_argument("--profile", default="", help="cProfile this engine's runs (vexact or fsdp); stats to stdout")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    setup_cpu_verl()
    from vexact_verl.tim import install

    install()  # as the vexact plugin does in every process
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(Path(tmp) / "ckpt", args.vocab, args.prompt + args.response + 8)
        for kind in args.engines.split(","):
            if args.profile != kind:
                results[kind] = run(kind, args, path)
                continue
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            results[kind] = run(kind, args, path)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(60)
    batch = rollout_batch(args.seqs, args.prompt, args.response, args.vocab)
    tokens = int(batch.batch["attention_mask"].sum())
    shape = f"{args.seqs} sequences x ({args.prompt} prompt max + {args.response} response), vocab {args.vocab}"
    print(f"{shape}, {args.threads} thread(s): {tokens} tokens per old_log_prob; us per token, mean of {args.repeats}")
    print(f"{'phase':<16}" + "".join(f"{k:>12}" for k in results))
    outside = {k: clock.outside_forward() for k, clock in results.items()}
    for ph in [*PHASES, "total", "outside_forward"]:
        row = [{"total": c.total(), "outside_forward": c.outside_forward()}.get(ph, c.s[ph]) for c in results.values()]
        print(f"{ph:<16}" + "".join(f"{v / (tokens * args.repeats) * 1e6:>12.2f}" for v in row))
    if set(outside) == set(ENGINES):
        print(f"outside the forward, vexact / fsdp: {outside['vexact'] / outside['fsdp']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
