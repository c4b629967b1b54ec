"""Peer engines for ``benchmarks/throughput.py``: vLLM (default and ``VLLM_BATCH_INVARIANT=1``), HF generate at batch
1, and the roofline bound every engine is measured against.

Written against vLLM 0.26.0's offline API (``vllm.LLM``, ``SamplingParams``, token-id prompts with
``skip_tokenizer_init=True``). vLLM comes from ``scripts/staging/vllm_device_wheels.sh`` (installed into
``/tmp/vllmsite`` on the device); without it every vLLM cell says "not installed" and the rest of the run is unaffected.

Each vLLM mode and batch limit runs in its own subprocess (``python benchmarks/peers.py --worker SPEC.json``) so its
GPU memory, its EngineCore process and its environment (``VLLM_BATCH_INVARIANT``) end with it. Both engines load the
same weights: the parent saves the random model as an HF checkpoint directory (``config.json`` + safetensors, no
tokenizer) and vLLM reads it. Each timed run's steps (requests and prompt tokens a step, and its time) come from the
step log of the plugin in ``examples/verify/vllm_plugin`` (``VEXACT_VLLM_STEP_LOG``), which the engine core process
writes (:func:`read_step_log`), for ``throughput.py``'s table of steps by batch size.

Where vLLM's decode step goes (``throughput.py --profile-steps``): a spec with ``profile`` runs :func:`decode_profile`
in a subprocess of its own, apart from the timed run (which keeps vLLM's default engine core process). It sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before vLLM is imported, so the engine core steps in this process and
torch.profiler sees its kernels (CUDA graph replays included); builds ``vllm.LLM`` with the timed worker's settings;
queues the spec's prompts (``LLM.enqueue``: final outputs only, as ``LLM.generate`` asks); steps ``llm.llm_engine``
until every request runs and has drawn two tokens; then, as VeXact's profile does (``profiling.decode_step_wall`` and
``decode_step_kernels``), the mean wall time of the next steps, then kernel time by kind over as many steps under
torch.profiler. With vLLM's async scheduling a ``step()`` launches one batch and returns the one before it, so the
mean over the steps is still one batch a step. The wall time is of the in-process engine core: the output processing
that the default engine overlaps with the core's step in another process runs between steps here (with final outputs
only and no detokenizing, a loop over the batch's requests).

Roofline: a decode step must read every weight once and the KV of every position its sequences attend. For a run of
requests with prompt lengths ``p_i`` and output lengths ``g_i`` at batch limit ``B`` the least it can read is
``ceil(sum g_i / B) * weight_bytes + sum_i sum_{t<g_i} (p_i + t) * kv_bytes_per_token`` (every step full; prefill
reads counted as one weight pass per ``max_num_batched_tokens`` prompt tokens). Divided by the measured device copy
bandwidth (bytes read + written, as elsewhere in the benchmarks) it is the least time; ``roofline fraction = that /
measured wall time``. The same bound holds for every engine on the same workload, so the column compares engines on
one scale and says how far each is from the memory wall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

NOT_INSTALLED = "not installed"
# the plugin's step log (examples/verify/vllm_plugin/vexact_vllm_plugin.py): set for each timed vLLM run
STEP_LOG = "VEXACT_VLLM_STEP_LOG"


def kv_bytes_per_token(cfg) -> int:
    """K and V of one position in every layer (bf16), as the engine's paged cache holds them (MLA: expanded)."""
    heads, k_dim, v_dim = cfg.kv_cache_dims
    return cfg.num_hidden_layers * heads * (k_dim + v_dim) * 2


def roofline_bytes(
    weight_bytes: int, kv_per_token: int, prompt_lens, gen_lens, batch_limit: int, tokens_per_step: int
) -> int:
    """Least bytes a run must read (module docstring): full decode steps + KV attended + prefill weight passes."""
    if len(prompt_lens) != len(gen_lens):
        raise ValueError(f"prompt_lens and gen_lens differ in length: {len(prompt_lens)} != {len(gen_lens)}")
    if batch_limit < 1 or tokens_per_step < 1:
        raise ValueError(f"batch_limit and tokens_per_step must be >= 1, got {batch_limit}, {tokens_per_step}")
    # the first output token comes from the prefill step; every later one from a decode step
    decode_tokens = sum(max(g - 1, 0) for g in gen_lens)
    steps = math.ceil(decode_tokens / batch_limit) + math.ceil(sum(prompt_lens) / tokens_per_step)
    # a decode step for output t (t >= 1) attends p + t positions (the prompt and the t tokens before it, itself)
    kv = sum(g * p + g * (g - 1) // 2 for p, g in zip(prompt_lens, gen_lens, strict=True)) - sum(
        p for p, g in zip(prompt_lens, gen_lens, strict=True) if g > 0
    )
    return steps * weight_bytes + kv * kv_per_token


def decode_weight_bytes(model) -> int:
    """Bytes of weights one batch-1 decode step must read: every parameter, except that a routed-expert tensor
    ``[E, ...]`` (``...experts.*``, 3-d) counts ``k / E`` of its bytes (the token goes through ``k`` experts of each MoE
    layer) and an input embedding not tied to the lm_head counts one row (the step looks up one token)."""
    cfg = model.config
    embed = model.model.embed_tokens.weight
    tied = embed is model.lm_head.weight
    total = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        size = p.numel() * p.element_size()
        if p.dim() == 3 and ".experts." in name:
            size = size * cfg.num_experts_per_tok // p.shape[0]
        elif p is embed and not tied:
            size = p.shape[1] * p.element_size()
        total += size
    return total


SOURCE_FILE = "vexact-source.json"


def save_hf_checkpoint(model, path: str | Path, source: dict | None = None) -> Path:
    """Save ``model`` (any vexact_models family: qwen3, qwen3_moe, deepseek_v3, llama, qwen2, mistral, gpt_oss) as an HF
    checkpoint directory vLLM and transformers can load (no tokenizer): ``config.json`` with the family's
    ``architectures`` and ``model_type``, and the weights under their published names (one tensor per expert).

    ``source``: what made the weights (shape, layers, seed, device, versions). It is written last, as
    ``vexact-source.json``; a directory that already holds the same ``source`` is used as it is, without writing
    (a full-depth MoE checkpoint is tens of GiB: ``throughput.py --ckpt-only`` writes it ahead of the run).

    Raises ``OSError`` before writing when the directory's file system has less free space than the weights."""
    from vexact_models import save_checkpoint

    path = Path(path)
    stamp = path / SOURCE_FILE
    if source is not None and stamp.is_file() and json.loads(stamp.read_text()) == source:
        print(f"HF checkpoint for vLLM: {path} holds these weights already ({SOURCE_FILE}); not rewritten")
        return path
    path.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # a write cut short must not pass for a whole checkpoint
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(path).free
    if free < need:
        raise OSError(
            f"the HF checkpoint for vLLM needs {need / 2**30:.1f} GiB and {path} has {free / 2**30:.1f} GiB free: "
            "point --ckpt-dir at a larger file system"
        )
    save_checkpoint(model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.setdefault("model_type", model.config.model_type)
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if source is not None:
        stamp.write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
    return path


def vllm_version(site: str | None) -> str | None:
    """vLLM's version as seen by a subprocess with ``site`` on its path, or None if it does not import."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", "import vllm; print(vllm.__version__)"], env=_env(site, False),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


# a vLLM general plugin that lets vLLM 0.24.0 load bf16 gpt-oss checkpoints (its module's docstring says why); it
# changes nothing for the other families or on a vLLM that loads them already
VLLM_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "verify" / "vllm_plugin"


def _env(site: str | None, batch_invariant: bool) -> dict:
    env = dict(os.environ)
    # FA4's site (scripts/staging/fa4_device_wheels.sh) carries apache-tvm-ffi in another version than vLLM's:
    # off vLLM's path
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "fa4site" not in p]
    env["PYTHONPATH"] = os.pathsep.join([str(VLLM_PLUGIN), *([site] if site else []), *parts])
    env["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
    # FlashInfer is not carried (scripts/staging/vllm_device_wheels.sh); vLLM 0.26 imports it when it builds its sampler
    # unless its top-k/top-p sampler is switched off. The workload samples with neither top-k nor top-p, so that
    # sampler would not run anyway (first H100 run: ModuleNotFoundError: No module named 'flashinfer').
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_vllm(
    mode: str,
    ckpt: Path,
    prompts,
    max_tokens,
    seeds,
    batch_limit: int,
    args,
    workdir: Path,
    batch1: bool,
    parallel: dict | None = None,
    profile: dict | None = None,
    round_tag: str = "",
) -> dict | str:
    """One vLLM engine in a subprocess; returns its results, or a short reason why there are none. ``round_tag``:
    appended to the worker's file names (``throughput.py --rounds``: one set of files a round). ``parallel``:
    more ``vllm.LLM`` settings for several GPUs (``tensor_parallel_size``, ``enable_expert_parallel``). ``profile``:
    ``{"batch": B, "context": C, "steps": S}``, where the decode step goes (:func:`decode_profile`) in place of the
    timed run; ``prompts``, ``max_tokens`` and ``seeds`` are then the profiled batch's requests."""
    if mode not in ("vllm", "vllm-bi"):
        raise ValueError(f"mode must be 'vllm' or 'vllm-bi', got {mode!r}")
    spec = dict(
        ckpt=str(ckpt), prompts=prompts, max_tokens=max_tokens, seeds=seeds, max_num_seqs=batch_limit,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt_len[1] + args.gen_len[1],
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        decode_steps=args.decode_steps if batch1 else 0, parallel=parallel or {},
        logprobs=0 if getattr(args, "vllm_logprobs", "sampled") == "sampled" else None,
    )  # fmt: skip
    if profile:
        spec["profile"] = profile
    tag = f"{mode}-{batch_limit}" + ("".join(f"-{k}{v}" for k, v in sorted((parallel or {}).items())))
    tag += ("-profile" if profile else "") + (f"-{round_tag}" if round_tag else "")
    spec_path, out_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("spec.json", "result.json", "log"))
    steps_path = workdir / f"{tag}.steps"
    spec_path.write_text(json.dumps(spec))
    env = _env(args.vllm_site, mode == "vllm-bi")
    if not profile:  # the timed run's steps, from the plugin's step log in vLLM's engine core process
        steps_path.unlink(missing_ok=True)
        env[STEP_LOG] = str(steps_path)
    with open(log_path, "w") as log:
        try:
            r = subprocess.run(
                [sys.executable, __file__, "--worker", str(spec_path), "--result", str(out_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.vllm_timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"timed out after {args.vllm_timeout} s (log {log_path})"
    if r.returncode != 0 or not out_path.exists():
        lines = log_path.read_text().strip().splitlines() or ["(no output)"]
        # the root cause (an engine core's exception) comes before vLLM's generic last line
        causes = [ln for ln in lines if re.search(r"\b\w+(Error|Exception): ", ln) and "Engine core init" not in ln]
        return f"failed (rc {r.returncode}): {(causes or lines)[-1].strip()[-160:]} (log {log_path})"
    res = json.loads(out_path.read_text())
    if res.get("batch_invariant") != (mode == "vllm-bi"):
        return f"VLLM_BATCH_INVARIANT was {res.get('batch_invariant')} in the {mode} worker (log {log_path})"
    if "window" in res and steps_path.exists():
        res["timeline"] = read_step_log(steps_path, *res["window"])
    return res


def read_step_log(path: Path, start: float, end: float) -> list[list]:
    """The timed run's steps from a step log of the plugin (``examples/verify/vllm_plugin``: ``TIME ROWS
    PROMPT_TOKENS`` a line, each ``schedule`` call): ``[rows, prompt_tokens, seconds]`` for each step scheduled
    within ``[start, end]`` (``time.perf_counter()``, one clock for every process of the machine), a step's seconds
    up to the next step's schedule call (the last one's up to ``end``). With vLLM's async scheduling a step is
    scheduled while the one before it runs, so in a steady run the intervals are the GPU's steps."""
    entries = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            t, rows, prompt = float(parts[0]), int(parts[1]), int(parts[2])
            if start <= t <= end:
                entries.append((t, rows, prompt))
    entries.sort()
    ends = [t for t, _, _ in entries[1:]] + [end]
    return [[rows, prompt, e - t] for (t, rows, prompt), e in zip(entries, ends, strict=True)]


def _worker(spec_path: str, result_path: str) -> int:
    """Runs inside the subprocess: build the vLLM engine, time the workload (and batch-1 decode), or with ``profile``
    in the spec profile its decode step (:func:`decode_profile`); write JSON."""
    spec = json.loads(Path(spec_path).read_text())
    if "profile" in spec:  # read when vLLM builds its engine: the engine core in this process, under torch.profiler
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["ckpt"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"], gpu_memory_utilization=spec["gpu_memory_utilization"],
        enforce_eager=spec["enforce_eager"], **spec.get("parallel", {}),
    )  # fmt: skip

    def params(n: int, seed: int | None):
        return SamplingParams(
            temperature=1.0, top_p=1.0, top_k=0, max_tokens=n, seed=seed, ignore_eos=True, detokenize=False,
            logprobs=spec.get("logprobs"),
        )  # fmt: skip

    def gen(prompts, ps):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)

    prompts, max_tokens, seeds = spec["prompts"], spec["max_tokens"], spec["seeds"]
    if "profile" in spec:
        requests = [params(n, s) for n, s in zip(max_tokens, seeds, strict=True)]
        res = decode_profile(llm, [{"prompt_token_ids": p} for p in prompts], requests, spec["profile"])
        return _write_result(res, result_path)
    gen(prompts[:4], [params(8, 1)] * min(4, len(prompts)))  # warm up
    _sync()
    t = time.perf_counter()
    outs = gen(prompts, [params(n, s) for n, s in zip(max_tokens, seeds, strict=True)])
    _sync()
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != sum(max_tokens):
        raise RuntimeError(f"vLLM returned {tokens} tokens, asked for {sum(max_tokens)} (ignore_eos)")
    if spec.get("logprobs") is not None:  # each drawn token's logprob came back: vLLM computed them
        got = sum(len(o.outputs[0].logprobs or []) for o in outs)
        if got != tokens:
            raise RuntimeError(f"vLLM returned logprobs for {got} of {tokens} tokens (logprobs={spec['logprobs']})")
    res = dict(tokens=tokens, wall=wall, tok_s=tokens / wall, window=[t, t + wall], logprobs=spec.get("logprobs"))
    if spec["decode_steps"]:
        res["step_s"] = batch1_step(lambda n: gen([list(range(1, 129))], [params(n, 0)]), spec["decode_steps"])
    return _write_result(res, result_path)


def _write_result(res: dict, result_path: str) -> int:
    import vllm

    res["version"] = vllm.__version__
    res["batch_invariant"] = os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
    Path(result_path).write_text(json.dumps(res))
    return 0


def _scheduler(llm):
    """The scheduler of an engine whose core steps in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
    ``InprocClient`` holds the ``EngineCore``)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        # short: the table cell keeps the last 160 characters of the error line
        raise RuntimeError(
            f"vLLM's engine core is not in this process ({type(llm.llm_engine.engine_core).__name__}): "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 not taken"
        )
    return core.scheduler


def _batch_state(sched) -> tuple[int, int, int, int]:
    """Running and waiting requests, the fewest tokens a running one has drawn and the fewest it has left."""
    running = list(sched.running)
    drawn = min((r.num_output_tokens for r in running), default=0)
    left = min((r.max_tokens - r.num_output_tokens for r in running), default=0)
    return len(running), len(sched.waiting), drawn, left


def decode_profile(llm, prompts, params, profile: dict) -> dict:
    """Where a decode step of the vLLM engine ``llm`` goes (module docstring): ``prompts`` (``profile["batch"]``
    token-id prompts of ``profile["context"]`` tokens) queued with ``params``, stepped until every one runs and has
    drawn two tokens; then ``profile["steps"]`` steps' mean wall ms (``step_ms``) and kernel time by kind over as many
    more under torch.profiler, as ``profiling.decode_step_kernels`` gives it, and the host gap (``host_gap_ms``).
    Raises where the batch is not whole for the measured steps (a request preempted, waiting or finished)."""
    import profiling  # benchmarks/profiling.py: this script's folder is on sys.path

    steps, batch = profile["steps"], profile["batch"]
    if len(prompts) != batch:
        raise ValueError(f"the profile asks for a batch of {batch} and got {len(prompts)} prompts")
    sched, engine = _scheduler(llm), llm.llm_engine
    llm.enqueue(prompts, params, use_tqdm=False)
    fill = 0
    while True:
        running, waiting, drawn, left = _batch_state(sched)
        if running == batch and not waiting and drawn >= 2:
            break
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the requests finished before all {batch} were decoding")
        engine.step()
        fill += 1
    # each measurement steps once first, and an async step may have scheduled one more draw than it returned
    need = 2 * (steps + 1) + 1
    if left < need:
        raise RuntimeError(f"after {fill} steps to fill the batch a request has {left} tokens left; the profile "
                           f"needs {need}: raise its max_tokens")  # fmt: skip
    preempted = sum(getattr(r, "num_preemptions", 0) for r in sched.running)
    wall = profiling.decode_step_wall(engine, steps)
    kernels = profiling.decode_step_kernels(engine, steps)
    running, waiting, _, _ = _batch_state(sched)
    after = sum(getattr(r, "num_preemptions", 0) for r in sched.running)
    if (running, waiting, after) != (batch, 0, preempted):
        raise RuntimeError(f"the batch changed during the measured steps: {running} running and {waiting} waiting "
                           f"of {batch}, preemptions {preempted} -> {after}")  # fmt: skip
    sched_cfg = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    shape = dict(batch=batch, context=profile["context"], steps=steps, step_ms=wall)
    return dict(shape, **kernels, host_gap_ms=wall - kernels["kernel_ms"], fill_steps=fill,
                async_scheduling=getattr(sched_cfg, "async_scheduling", None))  # fmt: skip


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def batch1_step(generate, steps: int, repeats: int = 3) -> float:
    """Seconds per decode step at batch 1 from whole calls: (time of 1 + steps tokens - time of 1 token) / steps,
    the best of ``repeats`` each (host work included, prefill cancelled out). ``generate(n)`` makes n tokens."""

    def best(n: int) -> float:
        ts = []
        for _ in range(repeats):
            _sync()
            t = time.perf_counter()
            generate(n)
            _sync()
            ts.append(time.perf_counter() - t)
        return min(ts)

    generate(2)  # warm up
    return max(best(1 + steps) - best(1), 0.0) / steps


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="vLLM worker for benchmarks/throughput.py (not for direct use)")
    ap.add_argument("--worker", required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    sys.exit(_worker(a.worker, a.result))
