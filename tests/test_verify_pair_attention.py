"""The vllm arm's actor attention on a CPU machine: examples/verify/actor_attention.py takes FlashAttention 4 only where
transformers would (flash-attn-4's dist-info on the path, its requirements met, apache-tvm-ffi from FA4's folder rather
than vLLM's), run_pair.sh puts the choice and FA4's folders into the vllm arm's command and path, the meta names the
attention and every setting that differs from verl's defaults, and verl 0.9.1's FSDP model path (transformers'
flash_attention_4 plus verl's remove-padding patch) hands a packed row to ``flash_attn.cute.flash_attn_varlen_func``
with one causal sequence per ``cu_seqlens`` span. The FA4 package here is a stand-in with flash-attn-4 4.0.0b36's
varlen signature that computes exact attention per sequence and, like the real one, takes only Python ints for
``max_seqlen_q`` / ``max_seqlen_k``; the CUDA kernel itself runs only on a GPU. transformers 5.9 passes those as 0-d
tensors (its ``prepare_fa_kwargs_from_position_ids``), so with it the arm takes FA4 through
``examples/verify/fa4_shim/fa4_varlen_ints.py`` (imported by verl's ``external_lib`` hook), which turns them into
ints; the FA4 path is also tested forced (``ACTOR_ATTN=flash_attention_4``) and on a transformers patched to pass
ints (``_ints_site``), where no shim is named."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "examples/verify/fa4_shim"
HAS_VERL = importlib.util.find_spec("verl") is not None
# verl.utils.import_utils (import_external_libs: how verl's workers import actor_rollout_ref.model.external_lib)
VERL_IMPORT_UTILS = Path(importlib.util.find_spec("verl").origin).parent / "utils/import_utils.py" if HAS_VERL else None

# flash-attn-4 4.0.0b36's flash_attn.cute.flash_attn_varlen_func parameters, in order (transformers inspects them to
# decide which keywords it passes: max_seqlen_q/k, deterministic, softcap, window_size, learnable_sink)
FA4_VARLEN_PARAMS = (
    "q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "min_seqlen_k", "seqused_q",
    "seqused_k", "gather_kv_indices", "page_table", "softmax_scale", "causal", "window_size", "learnable_sink",
    "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd", "mask_mod",
    "block_sparse_tensors", "aux_tensors", "aux_scalars", "return_lse", "scheduler_metadata", "seqlen_k_per_split",
    "disable_scheduler_metadata", "gather_bwd_recompute_p", "gather_bwd_token_chunk",
)  # fmt: skip

FAKE_CUTE = '''
"""Stand-in for flash-attn-4's flash_attn.cute on CPU: its varlen signature, exact causal attention per sequence."""
import torch

CALLS = []


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kwargs):
    raise NotImplementedError("a packed row goes through flash_attn_varlen_func")


def flash_attn_varlen_func({params}):
    for n in (max_seqlen_q, max_seqlen_k):
        if n is not None and not isinstance(n, int):  # flash-attn-4 builds CuTe shapes from them: ints only
            raise ValueError(f"Expected IntTuple, whose leaves are integers, but got {{n}}")
    CALLS.append({{"cu_seqlens_q": cu_seqlens_q.tolist(), "cu_seqlens_k": cu_seqlens_k.tolist(),
                   "dtype": str(cu_seqlens_q.dtype), "max_seqlen_q": int(max_seqlen_q), "causal": causal,
                   "softmax_scale": softmax_scale, "deterministic": deterministic, "q": tuple(q.shape),
                   "k": tuple(k.shape)}})
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens_q.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [heads, len, dim]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=softmax_scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)
'''


def _dist_info(site: Path, name: str, version: str, requires: list[str] = (), top_level: str | None = None) -> None:
    """A --target install's dist-info: METADATA, and top_level.txt and RECORD where the dist holds a package."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    record = [f"{info.name}/METADATA,,"]
    if top_level:
        (info / "top_level.txt").write_text(top_level + "\n")
        record += [f"{p.relative_to(site)},," for p in sorted((site / top_level).rglob("*.py"))]
    (info / "RECORD").write_text("\n".join(record) + "\n")


def _fake_fa4_site(site: Path, with_dist_info: bool = True) -> Path:
    """flash-attn-4 4.0.0b36 as rl_stack_wheels.sh installs it (pip --target): flash_attn/cute without a top-level
    __init__ (flash_attn is a namespace package), its dist-info, and the apache-tvm-ffi it needs."""
    cute = site / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    params = ", ".join(p if p in ("q", "k", "v") else f"{p}=None" for p in FA4_VARLEN_PARAMS)
    (cute / "__init__.py").write_text(FAKE_CUTE.format(params=params))
    if with_dist_info:
        _dist_info(site, "flash-attn-4", "4.0.0b36",
                   ["apache-tvm-ffi<0.2,>=0.1.11", 'nvidia-cutlass-dsl[cu13]>=4.6.2; extra == "cu13"'],
                   top_level="flash_attn")  # fmt: skip
        _dist_info(site, "apache-tvm-ffi", "0.1.15")
    return site


def _vllm_site(site: Path) -> Path:
    _dist_info(site, "apache-tvm-ffi", "0.1.9")  # vLLM 0.24.0's pin
    return site


# transformers as it would be if its packed-row call passed flash_attn_varlen_func Python ints for max_seqlen (the
# module's own calls look the name up as they run, and nothing else in transformers or verl imports it)
PASS_INTS = """
def pass_ints(module):
    prepare = module.prepare_fa_kwargs_from_position_ids

    def with_ints(position_ids):
        cu_seqlens, (max_q, max_k) = prepare(position_ids)
        return cu_seqlens, (int(max_q), int(max_k))

    module.prepare_fa_kwargs_from_position_ids = with_ints
"""

INTS_SITECUSTOMIZE = f'''
"""transformers as it would be if its packed-row call passed flash_attn_varlen_func Python ints for max_seqlen:
prepare_fa_kwargs_from_position_ids patched as its module loads (an interpreter that never imports it stays fast)."""
import importlib.util
import sys

MODULE = "transformers.modeling_flash_attention_utils"
{PASS_INTS}

class PatchOnImport:
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            pass_ints(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PatchOnImport())
'''


def _ints_site(site: Path) -> Path:
    """A folder whose sitecustomize patches transformers' prepare_fa_kwargs_from_position_ids to return ints: with it
    on PYTHONPATH, every interpreter run_pair.sh starts sees a transformers that FA4's varlen call accepts."""
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(INTS_SITECUSTOMIZE)
    return site


def _load_actor_attention():
    spec = importlib.util.spec_from_file_location("actor_attention", ROOT / "examples/verify/actor_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_finds_that_transformers_passes_fa4_a_tensor_max_seqlen():
    import torch
    import transformers
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    # transformers 5.9: max_length_q = cu_seq_lens_q.diff().max(), a 0-d tensor, handed on as max_seqlen_q/k
    _, (max_q, _) = prepare_fa_kwargs_from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    problem = _load_actor_attention().max_seqlen_problem("4.0.0b36")
    if isinstance(max_q, int):
        assert problem is None
        pytest.skip(f"transformers {transformers.__version__} passes ints")
    assert isinstance(max_q, torch.Tensor) and max_q.item() == 3
    assert f"transformers {transformers.__version__} passes max_seqlen_q/max_seqlen_k" in problem, problem
    assert "flash-attn-4 4.0.0b36 takes Python ints only" in problem, problem
    assert "Expected IntTuple, whose leaves are integers, but got 1079" in problem, problem


# actor_attention.py run as a script once per ACTOR_ATTN value given, in one interpreter; "--" after each run's lines
CHOOSE_EACH = """
import os
import runpy
import sys

for requested in sys.argv[1:]:
    os.environ["ACTOR_ATTN"] = requested
    try:
        runpy.run_path("examples/verify/actor_attention.py", run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    print("--", flush=True)
"""


def _choose(path: str, *requested: str) -> list[dict[str, str]]:
    """actor_attention.py's lines (as a dict) with ``path`` in front of PYTHONPATH, for each ACTOR_ATTN in
    ``requested`` (none: empty). The values share one interpreter (the choice imports torch and transformers: seconds),
    each run of the script on a path where the same imports give the same answers."""
    out = subprocess.run(
        [sys.executable, "-c", CHOOSE_EACH, *(requested or ("",))], cwd=ROOT, capture_output=True, text=True,
        check=True, env={**os.environ, "PYTHONPATH": f"{path}:{os.environ.get('PYTHONPATH', '')}"},
    ).stdout  # fmt: skip
    runs = out.split("--\n")
    assert runs[-1] == "" and len(runs) == len(requested or ("",)) + 1, out
    return [dict(shlex.split(line)[0].split("=", 1) for line in run.splitlines()) for run in runs[:-1]]


def test_fa4_only_from_its_distribution_with_every_requirement_met(tmp_path):
    fa4, vllm = _fake_fa4_site(tmp_path / "fa4site"), _vllm_site(tmp_path / "vllmsite")
    ints = _ints_site(tmp_path / "ints")  # a transformers that passes ints, as FA4's varlen call needs
    (got,) = _choose(f"{ints}:{fa4}:{vllm}")
    assert got["ACTOR_ATTN"] == "flash_attention_4" and got["ACTOR_ATTN_LIB"] == "", got  # no shim needed
    assert got["ACTOR_ATTN_WHY"].startswith(f"FA4: flash-attn-4 4.0.0b36 from {fa4}"), got
    # vLLM's folder first: its apache-tvm-ffi 0.1.9 is the one imported, below what flash-attn-4 needs
    (got,) = _choose(f"{ints}:{vllm}:{fa4}")
    assert got["ACTOR_ATTN"] == "sdpa"
    assert "needs apache-tvm-ffi<0.2,>=0.1.11; the path has 0.1.9 from " + str(vllm) in got["ACTOR_ATTN_WHY"], got
    # the package without its dist-info (transformers' is_flash_attn_4_available reads the distribution's name)
    bare = _fake_fa4_site(tmp_path / "bare", with_dist_info=False)
    (got,) = _choose(f"{ints}:{bare}:{vllm}")
    assert got["ACTOR_ATTN"] == "sdpa" and "no distribution provides flash_attn" in got["ACTOR_ATTN_WHY"], got
    (got,) = _choose(f"{ints}:{vllm}")
    assert got["ACTOR_ATTN"] == "sdpa", got
    kept = {"ACTOR_ATTN": "eager", "ACTOR_ATTN_WHY": "set by ACTOR_ATTN", "ACTOR_ATTN_LIB": ""}
    assert _choose(f"{vllm}:{fa4}", "eager") == [kept]


def test_fa4_with_int_lengths_where_transformers_passes_fa4_a_tensor_max_seqlen(tmp_path):
    import transformers

    fa4, vllm = _fake_fa4_site(tmp_path / "fa4site"), _vllm_site(tmp_path / "vllmsite")
    if _load_actor_attention().max_seqlen_problem("4.0.0b36") is None:
        pytest.skip(f"transformers {transformers.__version__} passes ints")
    # everything FA4 needs is there; transformers' call needs the shim. Chosen, then forced
    got, forced = _choose(f"{fa4}:{vllm}", "", "flash_attention_4")
    assert got["ACTOR_ATTN"] == "flash_attention_4" and got["ACTOR_ATTN_LIB"] == "fa4_varlen_ints", got
    why = got["ACTOR_ATTN_WHY"]
    assert why.startswith(f"FA4: flash-attn-4 4.0.0b36 from {fa4}"), why
    assert "; fa4_varlen_ints turns max_seqlen_q/max_seqlen_k into ints (transformers " in why, why
    assert "flash-attn-4 4.0.0b36 takes Python ints only" in why and "but got 1079" in why, why
    # forced: FA4 as asked, with the shim and its reason
    assert forced["ACTOR_ATTN"] == "flash_attention_4" and forced["ACTOR_ATTN_LIB"] == "fa4_varlen_ints", forced
    assert forced["ACTOR_ATTN_WHY"].startswith("set by ACTOR_ATTN; fa4_varlen_ints turns max_seqlen_q"), forced
    ints = _ints_site(tmp_path / "ints")
    forced = _choose(f"{ints}:{fa4}:{vllm}", "flash_attention_4")
    assert forced == [{"ACTOR_ATTN": "flash_attention_4", "ACTOR_ATTN_WHY": "set by ACTOR_ATTN", "ACTOR_ATTN_LIB": ""}]
    # what stops FA4 altogether still gives SDPA, and a forced FA4 names it
    got, forced = _choose(f"{vllm}:{fa4}", "", "flash_attention_4")
    assert got["ACTOR_ATTN"] == "sdpa" and got["ACTOR_ATTN_LIB"] == "", got
    assert forced["ACTOR_ATTN_WHY"].startswith(
        "set by ACTOR_ATTN; FA4 is not usable here (flash-attn-4 4.0.0b36 needs"
    ), forced


def test_the_shim_hands_fa4_ints_and_keeps_its_signature(tmp_path):
    import inspect

    import torch

    # its functions without the import-time install (no flash_attn in this interpreter)
    source = (SHIM / "fa4_varlen_ints.py").read_text()
    assert source.endswith("\ninstall()\n")
    module = type(sys)("fa4_varlen_ints")
    exec(compile(source.removesuffix("install()\n"), str(SHIM / "fa4_varlen_ints.py"), "exec"), module.__dict__)
    seen = []

    def varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, causal=False):
        seen.append((max_seqlen_q, max_seqlen_k, causal))
        return q

    wrapped = module.with_int_seqlens(varlen)
    assert inspect.signature(wrapped) == inspect.signature(varlen)  # transformers reads the keywords it may pass
    assert module.with_int_seqlens(wrapped) is wrapped  # installed once
    wrapped(1, 2, 3, max_seqlen_q=torch.tensor(1079), max_seqlen_k=torch.tensor(7, dtype=torch.int32), causal=True)
    wrapped(1, 2, 3, max_seqlen_q=5, max_seqlen_k=None)
    assert seen == [(1079, 7, True), (5, None, False)] and type(seen[0][0]) is int, seen
    with pytest.raises(ValueError, match=r"max_seqlen_q: expected one length, got a tensor of shape \(2,\)"):
        wrapped(1, 2, 3, max_seqlen_q=torch.tensor([3, 4]))
    # imported as verl imports an external_lib: without FA4, a clear error; with it, flash_attn.cute's function
    # replaced in place. One interpreter for both: FA4's folder joins the path after the failed import, which leaves
    # nothing in sys.modules. verl's hook is its import_utils.py loaded as a file: that module needs only the standard
    # library, and verl's package import (seconds: tensordict, transformers, its engines) adds nothing the shim uses;
    # the packed-row tests below import the shim through it after importing verl
    fa4 = _fake_fa4_site(tmp_path / "fa4site")
    code = textwrap.dedent(f"""
        import importlib, importlib.util, sys
        spec = importlib.util.spec_from_file_location("verl_import_utils", {str(VERL_IMPORT_UTILS)!r})
        verl_import_utils = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(verl_import_utils)
        import_external_libs = verl_import_utils.import_external_libs
        try:
            import_external_libs("fa4_varlen_ints")
            print("without FA4: imported")
        except Exception as e:
            print(f"without FA4: {{type(e).__name__}}: {{e}}")
        sys.path.insert(sys.path.index({str(SHIM)!r}) + 1, {str(fa4)!r})
        importlib.invalidate_caches()
        import_external_libs("fa4_varlen_ints")
        import flash_attn.cute as c
        print("with FA4:", c.flash_attn_varlen_func._vexact_int_seqlens)
    """)
    if HAS_VERL:
        env = {**os.environ, "PYTHONPATH": f"{SHIM}:{os.environ.get('PYTHONPATH', '')}"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        out = r.stdout + r.stderr[-2000:]
        assert r.returncode == 0, out
        assert "without FA4: ImportError: fa4_varlen_ints: flash_attn.cute (flash-attn-4) does not import" in out, out
        assert "with FA4: True" in r.stdout, out


def _dry_run(tmp_path: Path, *arms: str, **env: str) -> tuple[dict[str, list[str]], str]:
    r = subprocess.run(
        ["bash", "examples/verify/run_pair.sh", str(tmp_path / "results"), *arms],
        cwd=ROOT, env={**os.environ, "DRY_RUN": "1", "TAG": "cpu", "ACTOR_ATTN": "", **env}, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    arms_ = {w[0]: w[1:] for w in ([x for x in ln.split("\0") if x] for ln in r.stdout.splitlines())}
    return arms_, r.stderr


def _fa4_env(how: str, fa4: Path, ints: Path) -> tuple[dict[str, str], str, str]:
    """The environment that puts the vllm arm on FA4, the reason it prints, and the shim verl imports (empty where
    none is needed): ``forced`` by ACTOR_ATTN with this transformers, ``shim`` chosen with this transformers, or
    chosen on a transformers patched to pass ints (``ints``, the ``_ints_site`` folder)."""
    lib = "fa4_varlen_ints" if _load_actor_attention().max_seqlen_problem("4.0.0b36") else ""
    if how == "forced":
        return {"ACTOR_ATTN": "flash_attention_4"}, "set by ACTOR_ATTN", lib
    if how == "shim":
        return {}, f"FA4: flash-attn-4 4.0.0b36 from {fa4}", lib
    return {"PYTHONPATH": f"{ints}:{os.environ.get('PYTHONPATH', '')}"}, f"FA4: flash-attn-4 4.0.0b36 from {fa4}", ""


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> tuple[Path, Path, Path]:
    """FA4's folder, vLLM's and the ints patch's, one of each for the dry runs the tests below share."""
    root = tmp_path_factory.mktemp("sites")
    return _fake_fa4_site(root / "fa4site"), _vllm_site(root / "vllmsite"), _ints_site(root / "ints")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``_dry_run`` once per arguments: a run that two tests read (each its own aspect) starts once. Every dry run
    with FA4 on the path asks actor_attention.py, which imports torch and transformers: seconds each."""
    runs = {}

    def run(*arms: str, **env: str) -> tuple[dict[str, list[str]], str]:
        key = (arms, tuple(sorted(env.items())))
        if key not in runs:
            runs[key] = _dry_run(tmp_path_factory.mktemp("dry"), *arms, **env)
        return runs[key]

    return run


@pytest.mark.xdist_group("verify_pair_dry_runs")
@pytest.mark.parametrize("how", ["forced", "shim", "ints"])
@pytest.mark.parametrize("pair", ["dense-1k", "moe-1k"])
def test_run_pair_puts_fa4_and_its_folders_on_the_vllm_arm(sites, dry_run, pair, how):
    fa4, vllm, ints = sites
    key = ("actor_rollout_ref.actor.veomni.attn_implementation" if pair == "moe-1k"
           else "+actor_rollout_ref.model.override_config.attn_implementation")  # fmt: skip
    env, why, lib = _fa4_env(how, fa4, ints)
    arms, err = dry_run("vllm", "vexact", PAIR=pair, PYTHONPATH_FA4=str(fa4), PYTHONPATH_VLLM=str(vllm), **env)
    assert f"{key}=flash_attention_4" in arms["vllm"]
    # the shim where this transformers needs it: verl imports it in every worker, its folder first on the path
    assert [w for w in arms["vllm"] if "external_lib" in w] == ([f"actor_rollout_ref.model.external_lib={lib}"]
                                                                if lib else [])  # fmt: skip
    assert not [w for w in arms["vexact"] if "attn_implementation" in w or "external_lib" in w]  # its own kernels
    note = next(ln for ln in err.splitlines() if ln.startswith(f"== cpu-{pair}-vllm: "))
    assert f"actor attention flash_attention_4 ({why}" in note, note
    front = f"{SHIM}:" if lib else ""
    assert note.endswith(f"PYTHONPATH in front: {front}{fa4}:{vllm}"), note  # FA4's apache-tvm-ffi before vLLM's
    # no FA4 folder: SDPA, the reason in the note, vLLM's folder alone in front
    env.pop("ACTOR_ATTN", None)
    arms, err = dry_run("vllm", PAIR=pair, PYTHONPATH_FA4="", PYTHONPATH_VLLM=str(vllm), **env)
    assert f"{key}=sdpa" in arms["vllm"]
    note = next(ln for ln in err.splitlines() if ln.startswith(f"== cpu-{pair}-vllm: "))
    assert "actor attention sdpa (SDPA: FA4 is not usable here (" in note and note.endswith(f"front: {vllm}"), note
    arms, _ = dry_run("vllm", PAIR=pair, ACTOR_ATTN="eager", PYTHONPATH_FA4=str(fa4), **env)
    assert f"{key}=eager" in arms["vllm"]


@pytest.mark.parametrize("pair", ["dense-1k", "dense-4k", "moe-1k", "smoke"])
def test_dense_tuned_vllm_arm_takes_verls_fused_log_prob_kernel(tmp_path, pair):
    fused = ["actor_rollout_ref.model.use_fused_kernels=True",
             "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"]  # fmt: skip
    arms, _ = _dry_run(tmp_path, "vllm", "vexact", PAIR=pair, ACTOR_ATTN="sdpa")
    want = fused if pair.startswith("dense") else []  # VeOmni's MoE arm and the untuned smoke pair keep verl's path
    assert [w for w in arms["vllm"] if "fused_kernel" in w] == want, arms["vllm"]
    assert not [w for w in arms["vexact"] if "fused_kernel" in w]  # the vexact actor computes its own log-probs
    arms, _ = _dry_run(tmp_path, "vllm", PAIR=pair, ACTOR_ATTN="sdpa", FUSED_KERNELS="0")
    assert not [w for w in arms["vllm"] if "fused_kernel" in w]
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path / "r"), "vllm"], cwd=ROOT, text=True,
                       capture_output=True, env={**os.environ, "DRY_RUN": "1", "FUSED_KERNELS": "yes"})  # fmt: skip
    assert r.returncode == 2 and "FUSED_KERNELS must be 0 or 1, got 'yes'" in r.stderr, r.stderr


@functools.cache
def _compose(overrides: tuple[str, ...]):
    """verl's ppo_trainer config as Hydra composes it with ``overrides`` (cached: the tests only read it)."""
    from hydra import compose, initialize_config_dir

    # verl's trainer/config folder, found without importing verl (seconds; Hydra reads only the folder's YAML)
    config_dir = str(Path(importlib.util.find_spec("verl").origin).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")])


@pytest.mark.xdist_group("verify_pair_dry_runs")
@pytest.mark.skipif(not HAS_VERL, reason="reads verl's Hydra config; verl is not installed")
@pytest.mark.parametrize("how", ["forced", "shim", "ints"])
@pytest.mark.parametrize("pair", ["dense-4k", "moe-1k"])
def test_vllm_meta_names_the_attention_and_every_setting_that_differs_from_verl_defaults(
    tmp_path, sites, dry_run, pair, how
):
    from omegaconf import OmegaConf

    fa4, vllm, ints = sites
    fa4_env, want_why, _ = _fa4_env(how, fa4, ints)
    # the dry run of the test above where it has the pair (moe-1k): the vllm arm's command is the same with vexact's
    arms, err = dry_run("vllm", "vexact", PAIR=pair, PYTHONPATH_FA4=str(fa4), PYTHONPATH_VLLM=str(vllm), **fa4_env)
    cmd = arms["vllm"]
    note = next(ln for ln in err.splitlines() if ln.startswith(f"== cpu-{pair}-vllm: "))
    why = note.split(" (", 1)[1].rsplit("); PYTHONPATH", 1)[0]
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "ARM": "vllm", "NAME": f"cpu-{pair}-vllm", "RESULTS": str(results),
           "ATTN": "flash_attention_4", "ATTN_WHY": why, "ACTOR": "verl FSDP engine", "MOE": str(int(pair == "moe-1k")),
           "SHAPE": "qwen3-1.7b", "LAYERS": "28", "PAIR": pair, "VOCAB_SIZE": "151936", "RC": "0",
           "CMDLINE": " ".join(cmd), "COMMIT": "abc1234"}  # fmt: skip
    subprocess.run([sys.executable, "examples/verify/write_meta.py"], cwd=ROOT, env=env, check=True)
    meta = json.loads((results / f"cpu-{pair}-vllm.meta.json").read_text())
    assert meta["stack"]["attention"] == "flash_attention_4"
    assert meta["stack"]["attention_why"].startswith(want_why), meta["stack"]
    assert meta["stack"]["moe"] == ("VeOmni fused_triton" if pair == "moe-1k" else None)  # as the command sets it
    differs = meta["differs_from_verl_defaults"]
    # verl's defaults from its own Hydra composition (not the YAML write_meta reads): with the arm's engine group
    words = dict(w.lstrip("+").split("=", 1) for w in cmd[3:] if "=" in w and not w.startswith("hydra."))
    stock = _compose(())
    base = _compose((f"model_engine={words['model_engine']}",)) if "model_engine" in words else stock
    arm = _compose(tuple(cmd[3:]))
    for key in words:
        default = OmegaConf.select(stock if key == "model_engine" else base, key, default="<absent>")
        default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else default
        value = OmegaConf.select(arm, key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if default == "<absent>" or value != default:
            assert key in differs, (key, value, default)
            assert differs[key]["value"] == value, (key, differs[key], value)
            assert differs[key]["verl_default"] == (None if default == "<absent>" else default), (key, differs[key])
        else:
            assert key not in differs, (key, differs[key])
    assert set(differs) <= set(words)
    attn_key = ("actor_rollout_ref.actor.veomni.attn_implementation" if pair == "moe-1k"
                else "actor_rollout_ref.model.override_config.attn_implementation")  # fmt: skip
    want = "flash_attention_2" if pair == "moe-1k" else None  # VeOmni's default; the FSDP engine has no such key
    assert differs[attn_key] == {"value": "flash_attention_4", "verl_default": want}
    if pair == "moe-1k":
        assert differs["model_engine"] == {"value": "veomni", "verl_default": "dp"}
    for key in ("data.max_response_length", "actor_rollout_ref.actor.use_dynamic_bsz",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                "actor_rollout_ref.rollout.gpu_memory_utilization",
                "actor_rollout_ref.rollout.ignore_eos"):  # fmt: skip
        assert key in differs, key


RUN_PACKED = """
import os
import sys
import traceback

import torch

torch.cuda.is_available = lambda: True  # transformers' FA4 gate asks for CUDA; the stand-in runs on CPU
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # an H100 / H200
import flash_attn.cute as fake
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config
from verl.models.transformers.monkey_patch import apply_monkey_patch

# case -> what runs before the model is built (verl's worker imports its external_lib after verl, before the model)
CASES = {cases}


def run(path, prelude):
    exec(prelude)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    # verl's FSDP engine: the attention from override_config into AutoConfig, the model in fp32, then its patches
    hf = AutoConfig.from_pretrained(path, attn_implementation="flash_attention_4")
    model = AutoModelForCausalLM.from_pretrained(path, config=hf, torch_dtype=torch.float32)
    assert model.config._attn_implementation == "flash_attention_4", model.config._attn_implementation
    apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")

    lengths = [5, 7, 4]
    ids = [torch.randint(0, 97, (n,)) for n in lengths]
    packed = torch.cat(ids)[None]  # verl's remove-padding row: [1, total]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(input_ids=packed, attention_mask=None, position_ids=pos, use_cache=False).logits[0]
    logits.float().logsumexp(-1).sum().backward()
    want = torch.cat([ref(input_ids=x[None], use_cache=False).logits[0] for x in ids])
    calls = fake.CALLS
    print("RESULT", {{"max_diff": (logits - want).abs().max().item(), "calls": len(calls), "first": calls[0],
                      "grad": all(p.grad is not None for p in model.parameters() if p.requires_grad)}})


# each case in a child forked after the imports above (most of the interpreter's time): its own model folder,
# output files (CASE.out, CASE.err) and exit status
for name, prelude in CASES.items():
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, ext in ((1, "out"), (2, "err")):
            os.dup2(os.open(f"{{name}}.{{ext}}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        rc = 0
        try:
            run(os.path.abspath(f"model-{{name}}"), prelude)
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    print("CASE", name, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


# what verl's worker does with actor_rollout_ref.model.external_lib as it builds its model config
IMPORT_SHIM = "from verl.utils.import_utils import import_external_libs; import_external_libs('fa4_varlen_ints')"


def _run_packed(tmp_path: Path, cases: dict[str, str], *front: Path) -> dict[str, tuple[int, str, str]]:
    """RUN_PACKED's cases (name -> prelude) in one interpreter, with ``front`` and the FA4 stand-in on its path:
    name -> (exit status, stdout, stderr) of the case's child."""
    fa4 = _fake_fa4_site(tmp_path / "fa4site")
    script = tmp_path / "packed.py"
    script.write_text(RUN_PACKED.format(cases=repr(cases)))
    path = ":".join(str(p) for p in (*front, fa4))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": f"{path}:{os.environ.get('PYTHONPATH', '')}"})  # fmt: skip
    rcs = {w[1]: int(w[2]) for w in (ln.split() for ln in r.stdout.splitlines()) if len(w) == 3 and w[0] == "CASE"}
    assert r.returncode == 0 and set(rcs) == set(cases), r.stdout[-3000:] + r.stderr[-3000:]
    return {name: (rc, (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text())
            for name, rc in rcs.items()}  # fmt: skip


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """verl's FSDP model path on a packed row through the FA4 stand-in, each case in a child of one interpreter
    (importing verl takes seconds): ``plain`` (this transformers alone), ``shim`` (the shim imported through verl's
    hook) and ``ints`` (a transformers that passes ints: ``PASS_INTS`` on its module, as ``_ints_site`` applies it)."""
    cases = {"plain": "", "shim": IMPORT_SHIM,
             "ints": PASS_INTS + "import transformers.modeling_flash_attention_utils as m; pass_ints(m)"}  # fmt: skip
    return _run_packed(tmp_path_factory.mktemp("packed"), cases, SHIM)


@pytest.mark.slow
@pytest.mark.xdist_group("verify_pair_packed")
@pytest.mark.skipif(not HAS_VERL, reason="runs verl's remove-padding patch; verl is not installed")
def test_verl_fsdp_model_path_fails_in_fa4_varlen_on_a_tensor_max_seqlen(packed_runs):
    import transformers

    if _load_actor_attention().max_seqlen_problem("4.0.0b36") is None:
        pytest.skip(f"transformers {transformers.__version__} passes ints")
    rc, out, err = packed_runs["plain"]  # the first forward, as on the H200
    assert rc != 0 and "RESULT " not in out, out[-3000:]
    assert "ValueError: Expected IntTuple, whose leaves are integers, but got 7" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.xdist_group("verify_pair_packed")
@pytest.mark.skipif(not HAS_VERL, reason="runs verl's remove-padding patch; verl is not installed")
@pytest.mark.parametrize("how", ["shim", "ints"])
def test_verl_fsdp_model_path_hands_the_packed_row_to_fa4_varlen(packed_runs, how):
    # shim: this transformers, the shim imported through verl's hook; ints: a transformers that passes ints
    _, out, err = packed_runs[how]
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, out[-3000:] + err[-3000:]
    got = eval(line.removeprefix("RESULT "))  # a dict literal printed by the script above
    assert got["calls"] == 2, got  # one varlen call per layer, forward
    first = got["first"]
    assert first["cu_seqlens_q"] == first["cu_seqlens_k"] == [0, 5, 12, 16], first  # one span per packed sequence
    assert first["dtype"] == "torch.int32" and first["max_seqlen_q"] == 7 and first["causal"] is True, first
    assert first["q"] == (16, 4, 16) and first["k"] == (16, 2, 16), first  # [tokens, heads, head_dim], GQA kept
    assert first["deterministic"] is False and first["softmax_scale"] == pytest.approx(16**-0.5)
    assert got["max_diff"] < 1e-4, got  # the packed row equals each sequence run alone
    assert got["grad"], got


STUB_PYTHON = """#!/usr/bin/env bash
# python3 for run_pair.sh on CPU: the verl runs log one step (the meta written at their start kept aside) and exit
# with STUB_RC_<arm> (0 by default), vLLM "imports", the vexact arms' attention query answers triton (vexact_kernels'
# answer on a CPU machine; importing it takes seconds), compare.py writes its arguments to STUB_COMPARE, everything
# else is the real interpreter
if [ "$1" = -m ] && { [ "$2" = verl.trainer.main_ppo ] || [ "$2" = vexact_verl.main_ppo ]; }; then
  cp "${VERL_FILE_LOGGER_PATH%.jsonl}.meta.json" "${VERL_FILE_LOGGER_PATH%.jsonl}.meta-at-start.json"
  echo '{"step": 1, "data": {"rollout_corr/k3_kl": 0.001}}' > "$VERL_FILE_LOGGER_PATH"
  echo "Traceback: the stub arm's last line"
  rc=${VERL_FILE_LOGGER_PATH%.jsonl}
  rc=STUB_RC_${rc##*-}
  exit "${!rc:-0}"
fi
[ "$1" = -c ] && [ "$2" = "import vllm" ] && exit 0
[ "$1" = -c ] && [ "$2" = "import vexact_kernels as vk; print(vk.get_attention_impl())" ] && { echo triton; exit 0; }
[ "$1" = examples/verify/compare.py ] && { shift; echo "$*" > "$STUB_COMPARE"; exit 0; }
exec {python} "$@"
"""


def _stub_run(tmp_path: Path, *arms: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """run_pair.sh end to end with the stub python3 and sleep (dense-1k, tag cpu); the results folder."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(STUB_PYTHON.replace("{python}", sys.executable))
    # run_pair.sh sleeps 3 s after each arm for its Ray cluster and vLLM processes to exit; the stub arms start none
    (stub / "sleep").write_text("#!/usr/bin/env bash\nexit 0\n")
    for exe in ("python3", "sleep"):
        (stub / exe).chmod(0o755)
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(), data.mkdir()
    (model / "config.json").write_text("{}")
    (data / "train.parquet").write_text("")
    results = tmp_path / "results"
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "PAIR": "dense-1k", "TAG": "cpu", "ACTOR_ATTN": "",
           "MODEL_DIR": str(model), "DATA": str(data), "SHARED_HOST": "1", "COMMIT": "abc1234",
           "STUB_COMPARE": str(tmp_path / "compare.args"), **env}  # fmt: skip
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(results), *arms], cwd=ROOT, env=env,
                       capture_output=True, text=True)  # fmt: skip
    return r, results


@pytest.mark.skipif(not HAS_VERL, reason="write_meta reads verl's reference config; verl is not installed")
def test_run_pair_writes_the_meta_as_an_arm_starts_and_ends_with_its_attention(tmp_path):
    fa4, vllm = _fake_fa4_site(tmp_path / "fa4site"), _vllm_site(tmp_path / "vllmsite")
    env, why, _ = _fa4_env("ints", fa4, _ints_site(tmp_path / "ints"))
    r, results = _stub_run(tmp_path, "vllm", PYTHONPATH_FA4=str(fa4), PYTHONPATH_VLLM=str(vllm), STUB_RC_vllm="143",
                           **env)  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr  # the arm failed
    assert "== cpu-dense-1k-vllm: exit 143 after" in r.stdout, r.stdout
    log = (results / "cpu-dense-1k-vllm.log").read_text().splitlines()
    assert log[0].startswith(f"== cpu-dense-1k-vllm: actor attention flash_attention_4 ({why}"), log[0]
    assert log[0].endswith(f"PYTHONPATH in front: {fa4}:{vllm}"), log[0]
    start = json.loads((results / "cpu-dense-1k-vllm.meta-at-start.json").read_text())
    end = json.loads((results / "cpu-dense-1k-vllm.meta.json").read_text())
    assert (start["exit_code"], start["steps_logged"]) == (None, 0)  # a run stopped here keeps this meta
    assert (end["exit_code"], end["steps_logged"]) == (143, 1)
    for meta in (start, end):
        assert meta["stack"]["attention"] == "flash_attention_4"
        assert meta["stack"]["attention_why"].startswith(why)
        assert meta["differs_from_verl_defaults"]["actor_rollout_ref.model.override_config.attn_implementation"] == {
            "value": "flash_attention_4", "verl_default": None}  # fmt: skip
        assert meta["config"]["max_response_length"] == 1024 and meta["config"]["pair"] == "dense-1k"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VERL, reason="write_meta reads verl's reference config; verl is not installed")
@pytest.mark.parametrize(
    ("arms", "failing"),
    [(("vllm", "vexact", "fast"), None), (("vllm", "vexact", "fast"), "vllm"), (("vllm", "vexact"), "vexact")],
)
def test_run_pair_exits_1_when_an_arm_fails_and_compares_only_the_arms_that_ran(tmp_path, arms, failing):
    env = {f"STUB_RC_{failing}": "1"} if failing else {}
    r, results = _stub_run(tmp_path, *arms, PYTHONPATH_FA4="", **env)
    out = r.stdout + r.stderr
    for arm in arms:  # every arm runs and keeps its meta, the failed one too
        meta = json.loads((results / f"cpu-dense-1k-{arm}.meta.json").read_text())
        assert meta["exit_code"] == (1 if arm == failing else 0), (arm, meta["exit_code"])
        assert f"== cpu-dense-1k-{arm}: exit {meta['exit_code']} after" in r.stdout, out
    passed = [a for a in arms if a != failing]
    if failing is None:
        assert r.returncode == 0, out
        assert "Traceback: the stub arm's last line" not in r.stdout and "== failed" not in r.stderr, out
    else:
        assert r.returncode == 1, out
        assert "Traceback: the stub arm's last line" in r.stdout, out  # the tail of the failed arm's log
        assert f"== failed: {failing} (exit codes in their .meta.json" in r.stderr, out
    if len(passed) < 2:  # nothing to compare a run against
        assert not (tmp_path / "compare.args").exists(), out
        return
    compared = (tmp_path / "compare.args").read_text().split()
    assert compared[:-4] == [str(results / f"cpu-dense-1k-{a}.jsonl") for a in passed], compared
    assert compared[-4:] == ["--plot", str(results / "cpu-dense-1k.png"), "--expect-exact", "vexact"], compared
