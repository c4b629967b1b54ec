"""benchmarks/throughput.py's RL headline on CPU: the named workloads and how flags override them, the results file
(benchmarks/throughput_report.py) from made-up numbers, the kernel buckets of --profile-steps (benchmarks/profiling.py)
on made-up kernel names, the invariant-async mode (refused, naming the field, where EngineConfig lacks async_decode;
wired through where it has it), scripts/checks/rl_bench_gpu.sh's refusals, and the gpt-oss-20b shape (its published
sizes, ``--models gpt-oss-20b``, the family's path on the tiny config). The GPU run itself:
``scripts/checks/rl_bench_gpu.sh``."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from vexact_models import GPT_OSS_SHAPES, GptOssForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import profiling  # noqa: E402
import throughput  # noqa: E402
import throughput_report  # noqa: E402

TINY = ["--device", "cpu", "--models", "tiny", "--layers", "2", "--num-prompts", "3", "--prompt-len", "4", "9",
        "--gen-len", "2", "5", "--max-num-seqs", "2", "--decode-steps", "2", "--max-num-batched-tokens", "32",
        "--enforce-eager"]  # fmt: skip


def test_gpt_oss_20b_is_a_named_shape_with_its_published_sizes():
    """``--models gpt-oss-20b``: the released config.json's sizes, built as make_model builds them (on the meta
    device here: no weights): sliding layers (128 keys) alternating with full ones, a sink per query head, 32 biased
    experts top-4, 20.9B parameters."""
    family, sizes = throughput.SHAPES["gpt-oss-20b"]
    assert family == "gpt_oss" and sizes == GPT_OSS_SHAPES["gpt-oss-20b"]
    cfg = throughput.CONFIGS[family](**sizes, torch_dtype="bfloat16")
    published = dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088, sliding_window=128,
        max_position_embeddings=131072, rope_theta=150_000.0, tie_word_embeddings=False,
    )  # fmt: skip
    assert {k: getattr(cfg, k) for k in published} == published
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 12
    assert cfg.rope_scaling.factor == 32.0 and cfg.rope_scaling.original_max_position_embeddings == 4096
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 20.9
    layer = model.model.layers[0]
    assert layer.self_attn.sinks.shape == (64,) and layer.mlp.router.bias.shape == (32,)
    assert layer.mlp.experts.gate_up_proj.shape == (32, 2880, 2 * 2880)


def test_gpt_oss_20b_is_accepted_by_models(monkeypatch, tmp_path):
    """The shape passes ``--models``' check and reaches make_model under its name (the model itself is a stand-in)."""
    made = []
    monkeypatch.setattr(throughput, "make_model", lambda shape, layers, seed=0: made.append((shape, layers)) or shape)
    monkeypatch.setattr(throughput, "save_checkpoint", lambda model, shape, args, workdir: workdir / shape)
    argv = ["--device", "cpu", "--models", "gpt-oss-20b", "--layers", "2", "--ckpt-only", "--ckpt-dir", str(tmp_path)]
    assert throughput.main(argv) == 0
    assert made == [("gpt-oss-20b", 2)]


def test_tiny_gpt_oss_runs_on_cpu_with_hf_generate_and_writes_the_vllm_checkpoint(tmp_path):
    """The gpt_oss path end to end on the tiny config: VeXact invariant and HF generate (eager attention: transformers'
    gpt-oss has no sdpa), then the HF checkpoint directory vLLM would load, which transformers reads back."""
    transformers = pytest.importorskip("transformers")
    tiny = [*TINY[:3], "tiny-gpt-oss", *TINY[4:]]
    out = tmp_path / "r.md"
    argv = [*tiny, "--modes", "invariant,hf", "--grpo-prompts", "0", "--hf-prompts", "2", "--hf-new-tokens", "3"]
    assert throughput.main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    assert "## gpt_oss tiny-gpt-oss-shaped, 2 layers" in text
    assert "| HF generate (eager, eager attention) |" in text, text
    assert throughput.main([*tiny, "--ckpt-only", "--ckpt-dir", str(tmp_path / "ckpt")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt/gpt_oss-tiny-gpt-oss"))
    assert type(hf).__name__ == "GptOssForCausalLM" and hf.config.sliding_window == 24


def test_rl_workloads_expand_to_the_flags_and_explicit_flags_win():
    rl = throughput.parse_args(["--workload", "rl"])
    assert (rl.num_prompts, rl.prompt_len, rl.gen_len) == (1024, [128, 512], [1024, 2048])
    assert (rl.max_num_seqs, rl.max_num_batched_tokens, rl.grpo_prompts) == ("256,512", 8192, 0)
    assert rl.modes == "invariant,vllm,vllm-bi" and rl.preset_overrides == {}
    assert pickle.loads(pickle.dumps(rl)) == rl  # the invariant-fa4 mode sends it to a worker process
    long = throughput.parse_args(["--workload", "rl-long"])
    assert (long.num_prompts, long.gen_len, long.max_num_seqs) == (256, [4096, 8192], "256,512")
    cut = throughput.parse_args(["--workload", "rl", "--num-prompts", "512", "--gen-len", "1024", "2048"])
    assert cut.num_prompts == 512 and cut.preset_overrides == {"num_prompts": 512}  # the preset's own value: no note
    # a flag given at the parser's default still wins over the preset
    assert throughput.parse_args(["--workload", "rl", "--num-prompts", "256"]).num_prompts == 256
    assert throughput.parse_args([]).num_prompts == 256 and throughput.parse_args(["--quick"]).num_prompts == 64
    with pytest.raises(SystemExit):
        throughput.parse_args(["--quick", "--workload", "rl"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--workload", "rl-short"])


def _row(tok_s, **kw):
    return dict(tok_s=tok_s, roofline=0.41, decode_ms=16.24, wall=120.0, preemptions=0) | kw


def test_results_file_from_made_up_numbers():
    profile = dict(
        batch=256, context=1088, steps=20, step_ms=20.0, kernel_ms=15.0, host_gap_ms=5.0,
        buckets={"attention": 8.0, "GEMM": 5.0, "sampler/logprobs": 1.0, "norm/rotary/activation": 0.5, "other": 0.5},
        top_kernels=[("_attn_fwd", 7.5, "attention"), ("_matmul_kernel", 5.0, "GEMM")],
    )  # fmt: skip
    sections = [
        dict(
            model="qwen3 1.7b-shaped, 28 layers",
            rows={
                256: {"invariant": _row(12302.0), "vllm": _row(19656.0, decode_ms=None), "vllm-bi": _row(10000.0),
                      "invariant-async": "failed: RuntimeError: boom"},
                512: {"invariant": _row(13142.0), "vllm": "not installed", "vllm-bi": _row(10951.0),
                      "fast": _row(20000.0, baseline=True)},
            },
            profiles={256: {"invariant": profile, "invariant-async": "failed: RuntimeError: boom"}},
        )
    ]  # fmt: skip
    meta = dict(date="2026-11-28", gpu="NVIDIA H100 80GB HBM3", commit="abc1234", notes=["RL_NUM_PROMPTS=512: cut"],
                command="python benchmarks/throughput.py --workload rl", workload="Workload: the rl workload.",
                mode_names=throughput.MODE_NAMES)  # fmt: skip
    text = throughput_report.results_markdown(meta, sections)
    lines = text.splitlines()
    assert lines[0] == "# Engine throughput against vLLM (NVIDIA H100 80GB HBM3)"
    assert lines[2:7] == [
        "- Date: 2026-11-28", "- GPU: NVIDIA H100 80GB HBM3", "- Commit: abc1234",
        "- Command: `python benchmarks/throughput.py --workload rl`", "- RL_NUM_PROMPTS=512: cut",
    ]  # fmt: skip
    assert "## qwen3 1.7b-shaped, 28 layers, batch limit 256" in lines
    assert "## qwen3 1.7b-shaped, 28 layers, batch limit 512" in lines

    def row(name: str, after: str) -> list[str]:
        start = lines.index(after)
        hit = next(ln for ln in lines[start:] if ln.startswith(f"| {name} |"))
        return [c.strip() for c in hit.strip("|").split("|")]

    at256, at512 = (f"## qwen3 1.7b-shaped, 28 layers, batch limit {n}" for n in (256, 512))
    # engine | tok/s | / vLLM default | / vLLM batch-invariant | roofline | decode-only ms | wall | preemptions
    assert row("VeXact invariant", at256) == ["VeXact invariant", "12302", "0.63", "1.23", "0.41", "16.24", "120.0",
                                              "0"]  # fmt: skip
    assert row("vLLM default", at256)[1:6] == ["19656", "1.00", "1.97", "0.41", "-"]
    assert row("vLLM VLLM_BATCH_INVARIANT=1", at256)[2:4] == ["0.51", "1.00"]
    assert row("VeXact invariant, async decode", at256)[1:3] == ["failed: RuntimeError: boom", "-"]
    assert row("VeXact invariant", at512)[1:4] == ["13142", "-", "1.20"]  # no vLLM default: no ratio to it
    assert row("vLLM default", at512)[1] == "not installed"
    assert row("VeXact fast (mismatch baseline)", at512)[2:4] == ["-", "-"]  # the baseline has no ratio
    # the profile: ms per step by kind with its share of the step, the host gap, the costliest kernels
    ptable = next(ln for ln in lines if ln.startswith("| engine | batch |"))
    assert lines.index(at256) < lines.index(ptable) < lines.index(at512)
    head = row("engine", ptable)
    assert head == ["engine", "batch", "context", "step ms", "kernel ms", *profiling.BUCKETS, "host gap"]
    prof = row("VeXact invariant", ptable)
    assert prof[:5] == ["VeXact invariant", "256", "1088", "20.00", "15.00"]
    assert prof[5:] == ["8.00 (40%)", "5.00 (25%)", "0.00 (0%)", "1.00 (5%)", "0.50 (2%)", "0.50 (2%)", "5.00 (25%)"]
    assert row("VeXact invariant, async decode", ptable)[1] == "failed: RuntimeError: boom"
    assert any(ln.startswith("- VeXact invariant, costliest kernels") and "`_attn_fwd` 7.50 (attention)" in ln
               for ln in lines)  # fmt: skip
    assert sum(ln.startswith("| engine | batch |") for ln in lines) == 1  # no profile at 512: no table


def test_vllm_profile_rows_share_the_table_with_vexacts():
    """A vLLM profile (``peers.decode_profile``'s dict, top kernels as JSON gives them back: lists) is a row of the
    same table, with its costliest kernels and the note on how its rows were measured; a failed one is a cell saying
    why; a table without vLLM rows has no such note."""
    ours = dict(
        batch=256, context=1088, steps=20, step_ms=12.0, kernel_ms=11.8, host_gap_ms=0.2,
        buckets={"attention": 8.0, "GEMM": 2.5, "sampler/logprobs": 0.7, "norm/rotary/activation": 0.5, "other": 0.1},
        top_kernels=[("_attn_fwd", 8.0, "attention")],
    )  # fmt: skip
    theirs = dict(
        batch=256, context=1088, steps=20, step_ms=10.5, kernel_ms=9.8, host_gap_ms=0.7, fill_steps=36,
        async_scheduling=True, version="0.24.0", batch_invariant=False,
        buckets={"attention": 7.0, "GEMM": 2.0, "MoE": 0.0, "sampler/logprobs": 0.4, "norm/rotary/activation": 0.3,
                 "other": 0.1},
        top_kernels=[["void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<>>>", 7.0,
                      "attention"], ["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1.5, "GEMM"]],
    )  # fmt: skip
    failed = "failed (rc 1): RuntimeError: the batch changed during the measured steps (log /tmp/x.log)"
    profiles = {"invariant": ours, "vllm": theirs, "vllm-bi": failed}
    rows = {m: _row(10000.0) for m in profiles}
    meta = dict(date="2026-11-28", gpu="NVIDIA H200", commit="abc1234", command="python benchmarks/throughput.py",
                mode_names=throughput.MODE_NAMES)  # fmt: skip
    section = dict(model="qwen3 1.7b-shaped, 28 layers", rows={256: rows}, profiles={256: profiles})
    lines = throughput_report.results_markdown(meta, [section]).splitlines()
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| vLLM") and "(" in ln]
    assert table[0] == ["vLLM default", "256", "1088", "10.50", "9.80", "7.00 (67%)", "2.00 (19%)", "0.00 (0%)",
                        "0.40 (4%)", "0.30 (3%)", "0.10 (1%)", "0.70 (7%)"]  # fmt: skip
    assert table[1] == ["vLLM VLLM_BATCH_INVARIANT=1", failed] + ["-"] * (4 + len(profiling.BUCKETS))
    assert (
        "- vLLM default, costliest kernels (ms per step): `flash::FlashAttnFwdSm90` 7.00 (attention); "
        "`nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT` 1.50 (GEMM)" in lines
    )
    note = next(ln for ln in lines if ln.startswith("vLLM's rows:"))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in note and "lm_head is a cuBLAS GEMM" in note
    assert note.endswith("Async scheduling: vLLM default: on.")
    del profiles["vllm"], profiles["vllm-bi"]
    assert "vLLM's rows:" not in throughput_report.results_markdown(meta, [section])
    label = throughput_report.kernel_label
    assert label("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float>(float*)") == (
        "at::native::cunn_SoftMaxForward"
    )
    assert label("_attn_fwd") == "_attn_fwd" and label("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH"


def test_kernel_buckets_by_name():
    names = {
        "_attn_fwd": "attention", "_attn_combine": "attention", "_write_kv": "attention",
        "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_": "attention",
        "_matmul_kernel": "GEMM", "_matmul_tma_kernel": "GEMM", "_combine_kernel": "GEMM",
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "GEMM", "sm90_xmma_gemm_bf16bf16_bf16f32": "GEMM",
        "_grouped_mm_kernel": "MoE", "_route_kernel": "MoE", "_grouped_route_kernel": "MoE",
        "_logprobs_fwd_split_kernel": "sampler/logprobs", "_logprobs_fwd_combine_kernel": "sampler/logprobs",
        "_gumbel_noise_kernel": "sampler/logprobs", "_gumbel_argmax_kernel": "sampler/logprobs",
        "_log_softmax_kernel": "sampler/logprobs",
        "_rms_norm_fwd_pair_kernel": "norm/rotary/activation", "_add_rms_norm_fwd_kernel": "norm/rotary/activation",
        "_rotary_pair_kernel": "norm/rotary/activation", "_silu_and_mul_fwd_kernel": "norm/rotary/activation",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda": "other",
        "Memcpy HtoD (Pinned -> Device)": "other",
    }  # fmt: skip
    assert {n: profiling.kernel_bucket(n) for n in names} == names
    times = {"_attn_fwd": 4880.0, "_attn_combine": 120.0, "_matmul_kernel": 3000.0, "_gumbel_noise_kernel": 2.0,
             "_rotary_pair_kernel": 48.0, "Memcpy DtoH (Device -> Pinned)": 10.0}  # fmt: skip
    assert profiling.bucket_kernel_times(times) == {
        "attention": 5000.0, "GEMM": 3000.0, "MoE": 0.0, "sampler/logprobs": 2.0, "norm/rotary/activation": 48.0,
        "other": 10.0,
    }  # fmt: skip
    assert list(profiling.bucket_kernel_times({})) == list(profiling.BUCKETS)


def test_vllm_kernel_names_land_in_their_kind():
    """vLLM 0.24's decode-step kernels, named as the profiler records them (demangled, template arguments shortened):
    FA3 (vllm-project/flash-attention hopper/), vLLM's csrc/ kernels, Inductor's fusions, the batch-invariant mode's and
    the sampler's Triton kernels, and the V1 sampler's torch kernels (softmax, exponential draw, argmax)."""
    names = {
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
        "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
        "cute::tuple<cute::C<128>, cute::C<176>, cute::C<128> >, "
        "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90>, flash::CollectiveEpilogueFwd<>, "
        "flash::VarlenDynamicPersistentTileScheduler<128, 176, 256, 128, false, true> > > >(...)": "attention",
        "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<128> >, 7, 256, 1, "
        "false, true, cutlass::bfloat16_t, float, cutlass::arch::Sm90> >(...)": "attention",
        "void flash::prepare_varlen_num_blocks_kernel<1, true>(int, int, int, int const*, int const*)": "attention",
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)":
            "attention",
        "kernel_unified_attention_2d": "attention", "reduce_segments": "attention",
        "void vllm::rms_norm_kernel<c10::BFloat16, 8, 1024>(...)": "norm/rotary/activation",
        "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(...)": "norm/rotary/activation",
        "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)": "norm/rotary/activation",
        "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>(...)":
            "norm/rotary/activation",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm/rotary/activation",
        "triton_poi_fused_mul_silu_slice_1": "norm/rotary/activation", "_rms_norm_kernel": "norm/rotary/activation",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMM", "matmul_kernel_persistent": "GEMM",
        "bmm_kernel": "GEMM",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4>(...)": "GEMM",
        "void vllm::moe::topkGatingSoftmax<8, 128, 4, 16, int>(...)": "MoE",
        "void vllm::moe::topkGating<8, 128, 4, 16, 32, int, __nv_bfloat16, (vllm::moe::ScoringFunc)0>(...)": "MoE",
        "fused_moe_kernel": "MoE", "void vllm::moe::count_and_sort_expert_tokens_kernel<int>(...)": "MoE",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, "
        "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "sampler/logprobs",
        "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(...)":
            "sampler/logprobs",
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
        "at::native::templates::cuda::exponential_kernel<at::CUDAGeneratorImpl*>(at::TensorIteratorBase&, double, "
        "at::CUDAGeneratorImpl*)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::"
        "{lambda(curandStatePhilox4_32_10*)#2}>(...)": "sampler/logprobs",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
        "unsigned int, long, 4, 4> >(...)": "sampler/logprobs",
        "_log_softmax_kernel": "sampler/logprobs", "_temperature_kernel": "sampler/logprobs",
        "_gumbel_sample_kernel": "sampler/logprobs", "_topk_topp_kernel": "sampler/logprobs",
        "_min_p_kernel": "sampler/logprobs", "_penalties_kernel": "sampler/logprobs",
        # named for the functor only (the sampler's division by the temperature): not a kind the name tells
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
        "at::native::binary_internal::DivFunctor<float> > >(...)": "other",
        "triton_poi_fused_embedding_0": "other",
    }  # fmt: skip
    assert {n: profiling.kernel_bucket(n) for n in names} == names


def test_invariant_async_is_refused_naming_the_field_where_engine_config_lacks_it(monkeypatch, capsys):
    without = dataclasses.make_dataclass("EngineConfig", [("block_size", int, 16)])
    monkeypatch.setattr(throughput, "EngineConfig", without)
    with pytest.raises(throughput.UnsupportedMode, match=r"EngineConfig\(async_decode=True\).*no field async_decode"):
        throughput.engine_settings("invariant-async")
    with pytest.raises(SystemExit) as e:
        throughput.main([*TINY, "--modes", "invariant,invariant-async"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--modes: mode invariant-async" in err and "has no field async_decode" in err, err


def test_invariant_async_passes_async_decode_to_the_engine(monkeypatch, tmp_path, capsys):
    """Where EngineConfig has the field (a stand-in here), the mode builds its engines with async_decode=True, and
    its rows reach the results file, with the step profile of --profile-steps."""
    with_field = dataclasses.make_dataclass("EngineConfig", [("async_decode", bool, False)],
                                            bases=(throughput.EngineConfig,))  # fmt: skip
    monkeypatch.setattr(throughput, "EngineConfig", with_field)
    assert throughput.engine_settings("invariant-async") == ("invariant", {"async_decode": True})
    assert throughput.engine_settings("invariant-sync") == ("invariant", {"async_decode": False})
    assert throughput.engine_settings("invariant-joint") == ("invariant", {"split_mixed_steps": False})
    assert throughput.engine_settings("invariant-untuned") == ("invariant", {"tune_linears": False})
    assert throughput.engine_settings("invariant-2s") == ("invariant", {"decode_streams": 2})
    made = []

    class Recording(throughput.LLM):
        def __init__(self, *args, async_decode: bool = False, **kw):
            made.append(async_decode)
            super().__init__(*args, **kw)

    monkeypatch.setattr(throughput, "LLM", Recording)
    out = tmp_path / "rl.md"
    argv = ["--workload", "rl", *TINY, "--modes", "invariant-async", "--profile-steps", "2", "--results-md", str(out)]
    assert throughput.main(argv) == 0
    assert made == [True, True, True]  # the timed engine, the batch-1 engine, the profiled engine
    text = out.read_text()
    assert "- Flags in place of rl's own: --num-prompts 3, --prompt-len 4 9, " in text
    table = [ln for ln in text.splitlines() if ln.startswith("| VeXact invariant, async decode |")]
    assert len(table) == 2 and float(table[0].split("|")[2]) > 0, table  # the throughput row and the profile row
    assert table[1].split("|")[2].strip() == "2", table  # the profile's batch: the batch limit
    assert "VeXact invariant, async decode" in capsys.readouterr().out


def test_a_vexact_run_that_raises_leaves_its_cells_and_exit_status_1(monkeypatch, tmp_path):
    def boom(*a, **kw):
        raise RuntimeError("out of pages")

    monkeypatch.setattr(throughput, "engine_throughput", boom)
    monkeypatch.setattr(throughput, "decode_step_time", boom)
    out = tmp_path / "r.md"
    assert throughput.main([*TINY, "--modes", "invariant", "--grpo-prompts", "0", "--results-md", str(out)]) == 1
    assert "| VeXact invariant | failed: RuntimeError: out of pages | - |" in out.read_text()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "CUDA_VISIBLE_DEVICES must name one GPU, got ''"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES must name one GPU, got '0,1'"),
        ({"CUDA_VISIBLE_DEVICES": "0", "WORKLOAD": "rl-short"}, "WORKLOAD: unknown workload 'rl-short' (rl, rl-long)"),
        ({"CUDA_VISIBLE_DEVICES": "0", "RL_NUM_PROMPTS": "0"}, "RL_NUM_PROMPTS must be a positive integer, got '0'"),
        ({"CUDA_VISIBLE_DEVICES": "1", "PROFILE_STEPS": "x"}, "PROFILE_STEPS must be an integer >= 0, got 'x'"),
    ],
)
def test_rl_bench_gpu_refuses_bad_settings(tmp_path, env, message):
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run(["bash", "scripts/checks/rl_bench_gpu.sh", "1.7b", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, env=base | env, timeout=60)  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_linear_picks_lists_every_timed_shape(capsys):
    """The engine's timed linear forms as the results file names them (a stand-in runner), and its log lines."""
    bf16 = torch.bfloat16
    runner = types.SimpleNamespace(linear_tuning={
        (256, 2048, 2048, bf16): dict(ms={"default": 0.02, "ts64x64": 0.015}, differ=[], pick="ts64x64"),
        (256, 4096, 2048, bf16): dict(ms={"default": 0.03, "t64x64": 0.031}, differ=["s64x64"], pick=None),
    })  # fmt: skip
    assert throughput.linear_picks(runner) == {"256 2048 2048": "ts64x64", "256 4096 2048": "default"}
    out = capsys.readouterr().out
    assert "linear M=256 N=2048 K=2048: ts64x64 (us per matmul: ts64x64 15.0, default 20.0)" in out
    assert "other bits: ['s64x64']" in out
    assert throughput.linear_picks(types.SimpleNamespace()) == {}


def test_median_round_keeps_the_middle_run_and_the_spread():
    rows = [dict(tok_s=t, wall=1.0 / t, decode_wall=f"w{t}") for t in (30.0, 10.0, 20.0)]
    mid = throughput.median_round(rows)
    assert mid["tok_s"] == 20.0 and mid["tok_s_range"] == (10.0, 30.0) and mid["rounds"] == 3
    assert mid["decode_wall"] == "w20.0"  # the last round's profile timing
    assert throughput.median_round(rows[:2])["tok_s"] == 10.0  # the lower middle of an even count
    assert throughput.median_round(["failed: X", rows[0]])["tok_s_range"] == (30.0, 30.0)
    assert throughput.median_round(["failed: X", "failed: Y"]) == "failed: X"
    assert throughput.median_round([rows[1]]) is rows[1]
    assert throughput_report.tok_s_cell(mid) == "20 (10-30)" and throughput_report.tok_s_cell(rows[0]) == "30"


def test_rounds_run_every_mode_again_and_report_the_spread(monkeypatch, tmp_path, capsys):
    """--rounds 2 on the tiny model: two timed engines, one profile (the last round's), the spread in the results."""
    made = []
    real = throughput.engine_throughput

    def counting(model, mode, limit, prompts, params, args, keep=False, profile=0, **kw):
        made.append(profile)
        return real(model, mode, limit, prompts, params, args, keep, profile=profile, **kw)

    monkeypatch.setattr(throughput, "engine_throughput", counting)
    out = tmp_path / "r.md"
    argv = [*TINY, "--modes", "invariant", "--grpo-prompts", "0", "--rounds", "2", "--profile-steps", "1",
            "--results-md", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    assert made == [0, 1], made  # round 1 without the profile's timing, round 2 with it
    text = out.read_text()
    assert "2 rounds: every mode ran 2 times in turn" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| VeXact invariant |"))
    assert re.search(r"\| \d+ \(\d+-\d+\) \|", row), row
    assert "round 2 of 2: invariant at batch limit 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        throughput.main([*TINY, "--rounds", "0"])


def test_batch_ranges_cover_every_batch_size_once():
    assert throughput.batch_ranges(256) == [(256, 256), (192, 255), (128, 191), (64, 127), (16, 63), (2, 15), (1, 1)]
    for limit in (1, 2, 3, 8, 17, 256, 512):
        ranges = throughput.batch_ranges(limit)
        covered = sorted(b for lo, hi in ranges for b in range(lo, hi + 1))
        assert covered == list(range(1, limit + 1)), (limit, ranges)


def test_steps_by_batch_size_from_made_up_timelines():
    ours = [[256, 0, 0.010]] * 4 + [[256, 300, 0.014], [100, 0, 0.006], [1, 0, 0.002]]
    vllm = [[256, 0, 0.009]] * 4 + [[256, 300, 0.011], [100, 0, 0.005], [1, 0, 0.002], [0, 0, 0.002]]
    results = {(256, "invariant"): dict(timeline=ours, wall=0.070), (256, "vllm"): dict(timeline=vllm, wall=0.062)}
    buckets = throughput.step_buckets(ours, 256)
    assert buckets[("decode", (256, 256))] == [4, pytest.approx(0.040)]
    assert buckets[("prompt", (256, 256))] == [1, pytest.approx(0.014)]
    assert buckets[("decode", (64, 127))] == [1, pytest.approx(0.006)]
    assert buckets[("all", (256, 256))] == [5, pytest.approx(0.054)]
    lines = throughput.steps_by_batch_lines(results, 256, ["invariant", "vllm"])
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[5:]]
    kinds = [["all steps", "256"], ["all steps", "64-127"], ["all steps", "1"], ["all steps", "0"],
             ["decode only", "256"], ["decode only", "64-127"], ["decode only", "1"], ["decode only", "0"],
             ["with prompt tokens", "256"], ["whole run", "-"]]  # fmt: skip
    assert [row[:2] for row in table] == kinds
    assert table[0][2:] == ["5 x 10.80 ms = 0.05 s", "5 x 9.40 ms = 0.05 s", "+0.01"]
    assert table[4][2:] == ["4 x 10.00 ms = 0.04 s", "4 x 9.00 ms = 0.04 s", "+0.00"]
    assert table[8][2:] == ["1 x 14.00 ms = 0.01 s", "1 x 11.00 ms = 0.01 s", "+0.00"]
    assert table[7][2:] == ["-", "1 x 2.00 ms = 0.00 s", "-0.00"]
    assert table[9][2:] == ["7 steps, 0.06 s of 0.07 s wall", "8 steps, 0.06 s of 0.06 s wall", "+0.01"]
    assert throughput.steps_by_batch_lines({(256, "vllm"): "failed"}, 256, ["vllm"]) == []


def test_a_tiny_run_tells_its_steps_by_batch_size(tmp_path, capsys):
    out = tmp_path / "full.md"
    assert throughput.main([*TINY, "--modes", "invariant", "--grpo-prompts", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    table = text[text.index("Steps by batch size at batch limit 2") :].split("\n\n")[1].splitlines()
    split = text[text.index("| batch limit | engine | decode-only steps") :].split("\n\n")[0].splitlines()[2]
    decode, mixed = int(split.split("|")[3]), int(split.split("|")[5])
    total = table[-1].split("|")[3].strip()
    assert total.startswith(f"{decode + mixed} steps, "), (total, split)
    steps = json.loads((tmp_path / "full-steps-tiny.json").read_text())["2 invariant"]
    assert len(steps) == decode + mixed and sum(s[1] > 0 for s in steps) == mixed
    assert all(1 <= s[0] <= 2 and s[2] > 0 for s in steps), steps


def test_the_fine_graph_modes_pass_their_sizes_and_the_least_tuned_rows():
    assert throughput.engine_settings("invariant-fine") == (
        "invariant",
        {"cuda_graph_batch_sizes": throughput.FINE_GRAPH_SIZES},
    )
    backend, extra = throughput.engine_settings("invariant-fine-tuned")
    assert backend == "invariant" and extra["tune_linears_min_rows"] == 1
    sizes = throughput.FINE_GRAPH_SIZES
    assert list(sizes) == sorted(set(sizes)) and {1, 8, 24, 64, 96, 128, 160, 256, 512} <= set(sizes)
    cfg = throughput.EngineConfig(max_num_seqs=40, **extra)
    assert cfg.tune_linears_min_rows == 1 and cfg.graph_batch_sizes(on_cuda=True) == [1, 2, 4, 8, 16, 24, 32, 40]


def test_the_kernel_modes_set_their_constants_for_their_engine_only():
    from vexact_kernels import rotary
    from vexact_kernels.triton_ops import attention as ta
    from vexact_kernels.triton_ops import logprobs as lo

    def now():
        return ta.DECODE_LONGEST_FIRST, ta.DECODE_HEADS_FIRST, rotary.FUSE_KV_WRITE, lo.LOGPROBS_TMA_MIN_ROWS

    before = now()
    seen = {}
    modes = ("invariant", "invariant-slot", "invariant-lf", "invariant-hf", "invariant-kvsep", "invariant-tma1")
    for mode in modes:
        assert throughput.engine_settings(mode) == ("invariant", {}) and mode in throughput.MODE_NAMES
        with throughput.kernel_settings(mode):
            seen[mode] = now()
        assert now() == before
    assert seen == {"invariant": before, "invariant-slot": (False, False, *before[2:]),
                    "invariant-lf": (True, False, *before[2:]), "invariant-hf": (False, True, *before[2:]),
                    "invariant-kvsep": (*before[:2], False, before[3]), "invariant-tma1": (*before[:3], 1)}  # fmt: skip
    with pytest.raises(RuntimeError), throughput.kernel_settings("invariant-slot"):
        raise RuntimeError("an engine that fails restores them too")
    assert now() == before


def test_plot_steps_draws_the_runs_and_names_a_missing_one(tmp_path):
    import plot_steps

    steps = {"256 invariant": [[256, 300, 0.05]] + [[256, 0, 0.01]] * 5 + [[3, 0, 0.004]],
             "256 vllm": [[256, 300, 0.04]] + [[256, 0, 0.009]] * 5 + [[3, 0, 0.003]]}  # fmt: skip
    src = tmp_path / "steps.json"
    src.write_text(json.dumps(steps))
    s = plot_steps.series(steps["256 invariant"], window=2)
    assert s["rows"] == [256] * 6 + [3] and s["t"][-1] == pytest.approx(0.104)
    assert s["ms"][1] == pytest.approx(30.0) and s["ms_decode"][1] == pytest.approx(10.0)
    assert s["ms_decode"][0] != s["ms_decode"][0]  # NaN: no decode-only step in the window yet
    out = tmp_path / "steps.png"
    assert plot_steps.main([str(src), "--out", str(out), "--window", "2"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no run '512 vllm'"):
        plot_steps.main([str(src), "--out", str(out), "--runs", "256 vllm,512 vllm"])


def test_the_profiled_context_leaves_vllms_profile_its_draws():
    """Prompts of 1024 and 128 generated tokens (the batch sweep): vLLM's profile at batch 256 fills the batch, then
    measures twice; the context VeXact's profile takes leaves room for all of it. The rl workload keeps its mean."""
    sweep = types.SimpleNamespace(prompt_len=[1024, 1024], gen_len=[128, 128], max_num_batched_tokens=8192)
    for batch in (32, 128, 256):
        ctx = throughput.profile_context(batch, 1152, sweep, 20)
        need = throughput.profile_draws(batch, ctx, sweep, throughput.peer_profile_steps(20))
        assert ctx + need <= 1152 and ctx > 1024, (batch, ctx, need)
    rl = types.SimpleNamespace(prompt_len=[128, 512], gen_len=[1024, 2048], max_num_batched_tokens=8192)
    assert throughput.profile_context(256, 2560, rl, 20) == 320 + 768
