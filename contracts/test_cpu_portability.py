"""The CPU reference's bits do not depend on which code branch the CPU's math libraries take (design.md rule 9).

torch's CPU kernels pick a vector width from ``ATEN_CPU_CAPABILITY`` (default, avx2, avx512) and MKL picks a code
branch per CPU (``MKL_CBWR`` forces one: AVX2, COMPATIBLE, ...); on another CPU vendor both pick differently. The
golden workload (engine rollouts and the trainer's rescoring, cpu target) runs here in one subprocess per setting,
and every setting must give the same bits as the committed cpu fixtures. A library transcendental in the reference
(torch's float32 ``sqrt``, ``exp``, ``log``, ...) makes these differ on a machine where the branches round
differently; ``packages/vexact-kernels/tests/test_portable_math.py``'s canary names the primitive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from contracts import golden

ROOT = Path(__file__).resolve().parents[1]
# produce (engine and trainer, every op family and the sampler) for one dense family; the trainer's rescoring for
# MoE routing (softmax, top-k), DeepSeek-V3 (sigmoid routing, MLA, YaRN tables) and gpt-oss (window, sinks, the
# clamped SwiGLU's exp)
PRODUCE = ("qwen3",)
RESCORE = ("qwen3_moe", "deepseek_v3_top6", "gpt_oss")

_SCRIPT = f"""
import json, torch
from contracts import golden
out = {{}}
for f in {PRODUCE!r}:
    out[f] = golden.tensors_sha256(golden.produce("cpu", f))
for f in {RESCORE!r}:
    tensors, _ = golden.load("cpu", f)
    out[f] = golden.tensors_sha256(golden.rescore(tensors, "cpu", f))
print("RESULT " + json.dumps(out))
"""


def _settings() -> list[dict[str, str]]:
    caps = ["default", "avx2"]
    own = torch.backends.cpu.get_cpu_capability().lower()
    if own.startswith("avx512"):
        caps.append("avx512")
    if "ATEN_CPU_CAPABILITY" not in os.environ:  # then no setting runs this CPU's own capability: not twice
        caps = [c for c in caps if c != own]
    return [{}, {"MKL_CBWR": "AVX2"}, {"MKL_CBWR": "COMPATIBLE"}] + [{"ATEN_CPU_CAPABILITY": c} for c in caps]


def _run(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")}
    env.update(setting)
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rescore under {setting or 'no setting'} failed:\n{p.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _expected() -> dict[str, str]:
    out = {f: golden.load("cpu", f)[1]["sha256"] for f in PRODUCE}
    for f in RESCORE:
        tensors, _ = golden.load("cpu", f)
        out[f] = golden.tensors_sha256({k: tensors[k] for k in ("trainer_logprobs", "trainer_entropy")})
    return out


def test_golden_bits_independent_of_library_branch(target):
    if target != "cpu":
        pytest.skip("the library-branch settings are a CPU reference matter; GPU targets have their own fixtures")
    settings = _settings()
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(_run, settings))
    want = _expected()
    for setting, got in zip(settings, results, strict=True):
        for family, sha in want.items():
            assert got[family] == sha, (
                f"{family}: the cpu golden workload gives other bits under {setting or 'no setting'} than the "
                "committed fixture: a primitive of the CPU reference depends on the library's code branch "
                "(run packages/vexact-kernels/tests/test_portable_math.py to name it)"
            )
