"""Every command in a fenced bash block of a README or a docs page runs as written from the repository root.

Each command is listed below with what this test does with it: `RUN` runs the CPU ones (with the arguments given
there appended where the README's run takes minutes), in README order from a copy of the root (links to its entries,
its own `outputs/`), so a later command reads what an earlier one wrote; `GPU` ones must parse completely and be
refused in one line for want of CUDA (on a machine without it); `ELSEWHERE` names where the rest is run. A README
command missing from these lists fails the first test, and so does a path in any command that is not in the
repository.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

RUN = {  # command -> arguments appended (keeps the run to seconds)
    "python -m vexact tim rescore packages/vexact-trainer/tests/data/vllm_sample.jsonl --layout vllm": "",
    "python -m vexact tim attribute --prompts 4 --max-tokens 8": "",
    "python examples/getting_started/grpo.py --rollout-backend invariant": "--steps 2 --quiet",
    "python examples/getting_started/grpo.py --rollout-backend fast": "--steps 2 --quiet",
    "python examples/getting_started/plot.py": "",
    "python examples/data/prepare.py gsm8k --out outputs/data --from examples/data/samples/gsm8k.jsonl": "",
    "python examples/tim_study/fit_policy.py --preset tiny --lr 3e-3 --batch-size 64 --out outputs/tim_study/"
    "policy-tiny": "--steps 20 --eval-every 10 --quiet",
    "python examples/tim_study/sweep.py --from-fitted outputs/tim_study/policy-tiny --calibrate --calibration "
    "outputs/tim_study/calibration-tiny.json": "--calibrate-stds 0.01,0.1 --calibrate-prompts 2 --group-size 2",
    "python examples/tim_study/sweep.py --from-fitted outputs/tim_study/policy-tiny --calibration "
    "outputs/tim_study/calibration-tiny.json --arms exact,k3:1.5e-4,k3:1.5e-3,fast --lr 1e-4 --steps 20 --out "
    "outputs/tim_study/study-tiny.jsonl": "--steps 1 --corrections none --prompts-per-step 2 --group-size 2",
    "python examples/tim_study/report.py outputs/tim_study/study-tiny.jsonl --out outputs/tim_study/report-tiny": "",
}
GPU = {
    "python examples/tim_study/fit_policy.py --device cuda --preset small --out outputs/tim_study/policy",
    "python examples/tim_study/sweep.py --device cuda --from-fitted outputs/tim_study/policy --calibrate",
    "python examples/tim_study/sweep.py --device cuda --from-fitted outputs/tim_study/policy --arms exact --lr "
    "3e-5,1e-4,3e-4 --steps 300 --jobs 3 --resume --out outputs/tim_study/lr.jsonl",
    "python examples/tim_study/sweep.py --device cuda --from-fitted outputs/tim_study/policy --arms "
    "exact,k3:1.5e-4,k3:1.5e-3,fast --seeds 0,1,2 --steps 300 --lr 1e-4 --jobs 8 --resume --out "
    "outputs/tim_study/study.jsonl",
    "GPUS=0 PROCS=8 bash examples/tim_study/run_gpu.sh outputs/tim_study/gpu",
    "GPUS=1 PROCS=8 bash examples/tim_study/run_gpu.sh outputs/tim_study/gpu",
}
ELSEWHERE = {
    "actor_rollout_ref.actor.fsdp_config._target_=vexact_verl.actor_engine.VexactFSDPEngineConfig "
    "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_every=10": "Hydra overrides for a verl run; "
    "packages/vexact-verl/tests run the attribution keys",
    "python -m pip install -r requirements/cpu.txt && python -m vexact demo": "the demo: tests/test_repo.py; the "
    "install: CI (.ci/run installs requirements/test.txt, which includes it)",
    "python -m pip install -r requirements/test.txt && python -m pip install --no-deps -r requirements/veomni.txt "
    "&& python -m pytest -n auto": "CI runs exactly this (.ci/run)",
    "python examples/tim_study/report.py outputs/tim_study/lr-*.jsonl --out outputs/tim_study/lr-report": "reads "
    "the GPU lr probe's output; tests/test_tim_study.py runs report.py on CPU sweeps",
    "python examples/tim_study/report.py outputs/tim_study/study-*.jsonl --out outputs/tim_study/study": "reads "
    "the GPU sweep's output; tests/test_tim_study.py runs report.py on CPU sweeps",
    "python -m pip install packages/vexact-kernels": "tests/test_standalone_install.py",
    "python -m pip install packages/vexact-kernels packages/vexact-models": "tests/test_standalone_install.py",
    "python -m pip install packages/vexact-kernels packages/vexact-models packages/vexact-engine": "tests/"
    "test_standalone_install.py",
    "python -m pip install packages/vexact-kernels packages/vexact-models packages/vexact-trainer": "tests/"
    "test_standalone_install.py",
    "python -m pip install packages/vexact-kernels packages/vexact-models packages/vexact-engine "
    "packages/vexact-trainer 'packages/vexact-verl[verl]'": "tests/test_standalone_install.py",
    "source scripts/staging/device_env.sh && bash scripts/checks/trainer_gpu.sh h100": "GPU machines",
    "torchrun --standalone --nproc_per_node=1 -m contracts.fsdp_check --model qwen3-0.6b --out /tmp/fsdp": "GPU",
    "torchrun --standalone --nproc_per_node=2 -m contracts.fsdp_check --model qwen3-0.6b --out /tmp/fsdp": "GPUs",
    "torchrun --standalone --nproc_per_node=2 -m contracts.fsdp_check --model tiny-moe "
    "--router-aux-loss-coef 0.01": "two GPUs",
    "python -m vexact_verl.main_ppo <your verl GRPO/PPO overrides> actor_rollout_ref.rollout.name=vexact "
    "actor_rollout_ref.rollout.calculate_log_probs=True +actor_rollout_ref.rollout.engine_kwargs.vexact.backend="
    "invariant": "a template (the overrides are the user's); the CPU run: tests/test_verl_grpo_cpu.py",
    "python -m vexact_verl.main_ppo <overrides> actor_rollout_ref.rollout.name=vexact "
    "actor_rollout_ref.actor.strategy=vexact": "a template; the CPU run: tests/test_verl_grpo_cpu.py",
    "pip install --no-deps -r requirements/veomni.txt": "CI (.ci/run)",
    "python -m vexact_verl.main_ppo <overrides> model_engine=veomni actor_rollout_ref.rollout.name=vexact "
    "actor_rollout_ref.actor.veomni._target_=vexact_verl.veomni_engine.VexactVeOmniEngineConfig "
    "actor_rollout_ref.ref.veomni._target_=vexact_verl.veomni_engine.VexactVeOmniEngineConfig": "a template; "
    "packages/vexact-verl/README.md names the CPU run",
    "VERL_PLATFORM=cpu MODEL=... bash examples/verl_grpo/run_grpo.sh actor_rollout_ref.actor.strategy=vexact "
    "+ray_kwargs.ray_init.num_gpus=1 +ray_kwargs.ray_init.num_cpus=16 data.train_batch_size=8 "
    "actor_rollout_ref.actor.ppo_mini_batch_size=8 reward.num_workers=1 "
    "actor_rollout_ref.rollout.agent.num_workers=1": "tests/test_verl_grpo_cpu.py (about 5 minutes)",
    "python examples/data/prepare.py dapo_math --out data": "needs the hub; the hub path: tests/test_data_prepare.py",
    "MODEL_DIR=/models/Qwen3-1.7B DATA_DIR=data bash examples/recipes/qwen3_1.7b_grpo_gsm8k.sh "
    "trainer.total_epochs=3": "a GPU and a real checkpoint; every recipe with SMOKE=1 on CPU: tests/test_recipes.py",
    "MODEL_DIR=/models/Qwen3-1.7B DATA_DIR=outputs/data bash examples/recipes/qwen3_1.7b_grpo_gsm8k.sh": "a GPU "
    "and a real checkpoint; every recipe with SMOKE=1 on CPU: tests/test_recipes.py",
    "bash examples/verify/run_pair.sh outputs/verify": "a GPU with verl and vLLM; tests/test_verify_pair_config.py "
    "composes its arms on CPU",
    "bash examples/verify/run_pair.sh outputs/verify vexact fast": "a GPU with verl; tests/test_verify_pair_config.py "
    "composes its arms on CPU",
    "PAIR=dense-4k TAG=h200 CUDA_VISIBLE_DEVICES=0 SHARED_HOST=1 RAY_ADDRESS=local bash examples/verify/run_pair.sh "
    "outputs/verify vllm": "a GPU (H200) per arm; tests/test_verify_pair_attention.py and test_verify_pair_config.py "
    "check its command on CPU",
    "PAIR=dense-4k TAG=h200 CUDA_VISIBLE_DEVICES=1 SHARED_HOST=1 RAY_ADDRESS=local bash examples/verify/run_pair.sh "
    "outputs/verify vexact": "a GPU (H200) per arm; tests/test_verify_pair_attention.py and test_verify_pair_config.py "
    "check its command on CPU",
    "PAIR=moe-1k TAG=h200 CUDA_VISIBLE_DEVICES=0 SHARED_HOST=1 RAY_ADDRESS=local bash examples/verify/run_pair.sh "
    "outputs/verify vllm": "a GPU (H200) per arm; tests/test_verify_pair_attention.py and test_verify_pair_config.py "
    "check its command on CPU",
    "PAIR=moe-1k TAG=h200 CUDA_VISIBLE_DEVICES=1 SHARED_HOST=1 RAY_ADDRESS=local bash examples/verify/run_pair.sh "
    "outputs/verify vexact": "a GPU (H200) per arm; tests/test_verify_pair_attention.py and test_verify_pair_config.py "
    "check its command on CPU",
    "python examples/verify/compare.py outputs/verify/h200-dense-4k-vllm.jsonl "
    "outputs/verify/h200-dense-4k-vexact.jsonl --plot outputs/verify/h200-dense-4k.png --expect-exact vexact": "reads "
    "the GPU runs above; tests/test_verify_tools.py runs compare.py on synthetic and committed runs",
    "python benchmarks/rl_step.py outputs/verify/h200-dense-4k-vllm.jsonl outputs/verify/h200-dense-4k-vexact.jsonl "
    "--out outputs/verify/rl-step-h200-dense-4k.md": "reads the GPU runs above; tests/test_verify_tools.py runs "
    "rl_step.py on synthetic and committed runs",
    "python examples/verify/gen_profile.py outputs/verify/h200-dense-4k-vllm.jsonl "
    "outputs/verify/h200-dense-4k-vexact.jsonl --out outputs/verify/gen-h200-dense-4k.md": "reads the GPU runs "
    "above; tests/test_gen_profile.py runs gen_profile.py on synthetic and committed runs",
    "python examples/verl_grpo/make_dataset.py --out outputs/verl_grpo/arith": "packages/vexact-verl/tests/"
    "test_examples.py",
    "python examples/verl_grpo/make_model.py --out outputs/verl_grpo/qwen3-random": "packages/vexact-verl/tests/"
    "test_examples.py",
    "MODEL=outputs/verl_grpo/qwen3-random DATA=outputs/verl_grpo/arith bash examples/verl_grpo/run_grpo.sh "
    "actor_rollout_ref.actor.strategy=vexact": "a GPU; the CPU run: packages/vexact-verl/tests/test_verl_grpo_cpu.py",
    "ray start --head --port=6379": "a Ray cluster of several nodes",
    "ray start --address=HEAD_IP:6379": "a Ray cluster of several nodes",
    "NNODES=4 GPUS_PER_NODE=8 MODEL_DIR=/shared/Qwen3-30B-A3B DATA_DIR=/shared/data bash "
    "examples/recipes/qwen3_30b_a3b_reinforce_pp_dapo_math.sh": "4 nodes of 8 GPUs; SMOKE=1: tests/test_recipes.py",
}


def readmes() -> list[Path]:
    """Every README.md of the repository and every page of the docs site (docs/*.md)."""
    skip = {".git", "outputs", ".nox", "node_modules", "site"}
    found = [p for p in ROOT.rglob("README.md") if not skip & set(p.relative_to(ROOT).parts)]
    return sorted(found + list((ROOT / "docs").glob("*.md")))


def commands(readme: Path) -> list[str]:
    """The commands of every fenced bash block: continuation lines joined, comments dropped."""
    found, block = [], None
    for line in readme.read_text().splitlines():
        fence = line.strip().startswith("```")
        if block is None and fence:
            block = [] if line.strip()[3:].strip() in ("bash", "sh", "shell") else "other"
        elif block is not None and fence:
            if block != "other":
                text = re.sub(r"\\\n\s*", "", "\n".join(block))
                for ln in text.splitlines():
                    cmd = re.split(r"\s+#", ln)[0].strip()
                    if cmd and not cmd.startswith("#"):
                        found.append(" ".join(cmd.split()))
            block = None
        elif block not in (None, "other"):
            block.append(line)
    return found


def all_commands() -> list[tuple[Path, str]]:
    return [(r, c) for r in readmes() for c in commands(r)]


def test_every_readme_command_is_listed_and_its_paths_exist():
    listed = set(RUN) | GPU | set(ELSEWHERE)
    seen = set()
    for readme, cmd in all_commands():
        where = readme.relative_to(ROOT)
        assert cmd in listed, f"{where}: {cmd!r} is in no list of tests/test_readme_commands.py"
        seen.add(cmd)
        for token in shlex.split(cmd.replace("<", "'<").replace(">", ">'")):
            path = token.split("=")[-1].split("[")[0]
            if "/" in path and not path.startswith(("/", "-", "$", "<", "outputs/", "http")) and "..." not in path:
                assert (ROOT / path).exists(), f"{where}: {cmd!r} names {path}, which is not in the repository"
    assert seen == listed, f"listed but in no README: {sorted(listed - seen)}"


def _copy_of_root(tmp: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name not in ("outputs", ".git"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize(
    "readme", [r for r in readmes() if any(c in RUN for c in commands(r))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_cpu_commands_run_from_the_root(readme, tmp_path):
    cwd = _copy_of_root(tmp_path)
    for cmd in commands(readme):
        if cmd not in RUN:
            continue
        full = f"{cmd} {RUN[cmd]}".strip()
        out = subprocess.run(["bash", "-c", full], cwd=cwd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{readme.name}: {full}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert (cwd / "outputs").is_dir()  # the defaults write under outputs/ of the current directory


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the GPU commands would run for minutes")
@pytest.mark.parametrize("cmd", sorted(GPU))
def test_gpu_commands_parse_and_are_refused_without_cuda(cmd, tmp_path):
    out = subprocess.run(
        ["bash", "-c", cmd], cwd=_copy_of_root(tmp_path), capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.returncode == 2 and "--device cuda: this machine has no CUDA device" in out.stderr, out.stderr[-2000:]


def test_root_readme_use_snippet_runs(tmp_path):
    """The README's Python example (text and token-id prompts, the ok check, engine == trainer) as written."""
    code = re.search(r"## Use\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code, "README.md: a python block right under ## Use"
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
