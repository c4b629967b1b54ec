"""benchmarks/throughput.py's peer columns on CPU: the roofline bound, the HF checkpoint vLLM reads, and the vLLM
subprocess plumbing (against a stand-in ``vllm`` package: the real one needs a GPU), with and without vLLM."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vexact_models import QWEN3_SHAPES, tiny_qwen3_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers  # noqa: E402
import profiling  # noqa: E402
import throughput  # noqa: E402

TINY = ["--device", "cpu", "--models", "tiny", "--layers", "2", "--num-prompts", "3", "--prompt-len", "4", "9",
        "--gen-len", "2", "5", "--max-num-seqs", "2,4", "--decode-steps", "2", "--max-num-batched-tokens", "32",
        "--enforce-eager"]  # fmt: skip

# a stand-in for vLLM 0.26's offline API: checks the checkpoint directory (transformers loads it in the test above)
# and returns ignore_eos-length outputs; it records the prompts it got to compare with the engine's workload. For the
# decode-step profile: LLM.enqueue and an llm_engine whose step() starts two waiting requests and has each running one
# draw a token; its scheduler is reachable only where the engine core would run in-process, as in vLLM (InprocClient)
FAKE_VLLM = textwrap.dedent("""
    import json, os, pathlib, types
    __version__ = "0.0-fake"
    IN_PROCESS = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # vLLM reads it when it builds its engine
    class SamplingParams:
        def __init__(self, **kw):
            assert kw["ignore_eos"] and kw["detokenize"] is False and kw["temperature"] == 1.0, kw
            self.max_tokens, self.seed, self.logprobs = kw["max_tokens"], kw["seed"], kw["logprobs"]
    class _Request:
        def __init__(self, max_tokens):
            self.max_tokens, self.num_output_tokens, self.num_preemptions = max_tokens, 0, 0
    class _Engine:
        def __init__(self):
            self.sched = types.SimpleNamespace(running=[], waiting=[])
            core = types.SimpleNamespace(scheduler=self.sched)
            self.engine_core = types.SimpleNamespace(engine_core=core) if IN_PROCESS else types.SimpleNamespace()
            self.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(async_scheduling=True))
        def has_unfinished_requests(self):
            return bool(self.sched.running or self.sched.waiting)
        def step(self):
            s = self.sched
            for r in s.running:
                r.num_output_tokens += 1
            s.running = [r for r in s.running if r.num_output_tokens < r.max_tokens] + s.waiting[:2]
            del s.waiting[:2]
            return []
    class LLM:
        def __init__(self, model, skip_tokenizer_init, dtype, **kw):
            assert skip_tokenizer_init and dtype == "bfloat16"
            self.dir = pathlib.Path(model)
            cfg = json.loads((self.dir / "config.json").read_text())
            arch = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM"}[cfg["model_type"]]
            assert cfg["architectures"] == [arch] and cfg["torch_dtype"] == "bfloat16", cfg
            assert (self.dir / "model.safetensors").exists()
            self.llm_engine = _Engine()
        def generate(self, prompts, params, use_tqdm):
            assert not IN_PROCESS, "the timed run keeps vLLM's engine core process"
            with open(self.dir / f"seen-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps([p["prompt_token_ids"] for p in prompts]) + "\\n")
            if os.environ.get("VEXACT_VLLM_STEP_LOG"):  # the plugin's step log: a line a step, as the engine core
                import time
                with open(os.environ["VEXACT_VLLM_STEP_LOG"], "a") as f:
                    for i in range(max(p.max_tokens for p in params)):
                        rows = sum(p.max_tokens > i for p in params)
                        f.write(f"{time.perf_counter():.6f} {rows} {7 * rows if i == 0 else 0}\\n")
            drop = os.environ.get("FAKE_VLLM_NO_LOGPROBS") == "1"  # a build that ignores logprobs=
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                        token_ids=[0] * p.max_tokens,
                        logprobs=None if p.logprobs is None or drop else [{0: -1.0}] * p.max_tokens)])
                    for p in params]
        def enqueue(self, prompts, params, use_tqdm):
            if os.environ.get("FAKE_VLLM_FAIL_BI") and os.environ["VLLM_BATCH_INVARIANT"] == "1":
                raise RuntimeError("no queue in this build")
            assert len(prompts) == len(params)
            self.llm_engine.sched.waiting += [_Request(p.max_tokens) for p in params]
""")


def test_decode_weight_bytes_counts_k_of_e_experts_and_one_row_of_an_untied_embedding():
    from vexact_models import random_model, tiny_deepseek_v3_config

    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    dense = random_model(cfg)
    assert peers.decode_weight_bytes(dense) == sum(p.numel() * p.element_size() for p in dense.parameters())
    untied = random_model(tiny_qwen3_config(tie_word_embeddings=False))
    embed = untied.model.embed_tokens.weight
    full = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert peers.decode_weight_bytes(untied) == full - (embed.numel() - embed.shape[1]) * embed.element_size()
    moe = random_model(tiny_deepseek_v3_config())
    experts = [p for n, p in moe.named_parameters() if ".experts." in n and p.dim() == 3]
    e, k = experts[0].shape[0], moe.config.num_experts_per_tok
    expert_bytes = sum(p.numel() * p.element_size() for p in experts)
    embed = moe.model.embed_tokens.weight
    full = sum(p.numel() * p.element_size() for p in moe.parameters())
    want = full - expert_bytes + expert_bytes * k // e - (embed.numel() - embed.shape[1]) * embed.element_size()
    assert peers.decode_weight_bytes(moe) == want < full


def test_roofline_bytes_counts_full_steps_kv_attended_and_prefill_passes():
    # two requests, prompts 10 and 20, outputs 3 and 1, batch limit 2, 16 prompt tokens a step:
    # decode tokens 2 -> 1 step; prefill 30 tokens -> 2 passes; KV: request 0 attends 11 + 12, request 1 nothing
    assert peers.roofline_bytes(1000, 7, [10, 20], [3, 1], 2, 16) == 3 * 1000 + (11 + 12) * 7
    assert peers.roofline_bytes(1000, 7, [10], [0], 1, 16) == 1000
    with pytest.raises(ValueError, match="prompt_lens and gen_lens"):
        peers.roofline_bytes(1, 1, [1, 2], [1], 1, 1)
    with pytest.raises(ValueError, match="batch_limit"):
        peers.roofline_bytes(1, 1, [1], [1], 0, 1)


FAMILY_SHAPES = ["tiny", "tiny-qwen3-moe", "tiny-deepseek", "tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gpt-oss"]
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM", "gpt_oss": "GptOssForCausalLM"}  # fmt: skip


@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_hf_checkpoint_holds_the_same_weights(shape, tmp_path):
    """Every family's checkpoint for vLLM: the published architecture and names (one tensor per expert), which
    transformers and vexact_models' own loader read back to the same weights."""
    import transformers
    from safetensors import safe_open

    from vexact_models import expected_tensors, load_model

    throughput.DEV = torch.device("cpu")
    model = throughput.make_model(shape, 2)
    family = throughput.SHAPES[shape][0]
    path = peers.save_hf_checkpoint(model, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURES[family]] and cfg["model_type"] == family, cfg
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(expected_tensors(model))
    if family in ("qwen3_moe", "deepseek_v3"):
        assert any(n.endswith(".mlp.experts.0.gate_proj.weight") for n in names), sorted(names)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert hf.config.model_type == family and hf.dtype == torch.bfloat16
    ours = model.state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(t, ours[name]), name
    back = load_model(path, dtype="bfloat16")
    for name, t in back.state_dict().items():
        assert torch.equal(t, ours[name]), name


def test_checkpoint_needs_the_free_space(tmp_path, monkeypatch):
    throughput.DEV = torch.device("cpu")
    model = throughput.make_model("tiny", 2)
    monkeypatch.setattr(peers.shutil, "disk_usage", lambda p: argparse.Namespace(free=1000))
    with pytest.raises(OSError, match=r"has 0\.0 GiB free: point --ckpt-dir at a larger file system"):
        peers.save_hf_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()


def test_ckpt_only_writes_once_and_a_later_run_reuses_it(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    assert throughput.main([*TINY, "--ckpt-only", "--ckpt-dir", str(work)]) == 0
    ckpt = work / f"{throughput.SHAPES['tiny'][0]}-tiny"
    written = (ckpt / "model.safetensors").stat().st_mtime_ns
    source = json.loads((ckpt / peers.SOURCE_FILE).read_text())
    assert source["shape"] == "tiny" and source["layers"] == 2 and source["seed"] == 0 and source["device"] == "cpu"

    def no_write(*a, **kw):
        raise AssertionError("the checkpoint was written again")

    import vexact_models

    monkeypatch.setattr(vexact_models, "save_checkpoint", no_write)
    args = argparse.Namespace(layers=2, seed=0)
    model = throughput.make_model("tiny", 2)
    assert throughput.save_checkpoint(model, "tiny", args, work) == ckpt  # same source: used as it is
    assert "not rewritten" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="written again"):  # another seed: other weights, written anew
        throughput.save_checkpoint(model, "tiny", argparse.Namespace(layers=2, seed=1), work)
    assert not (ckpt / peers.SOURCE_FILE).exists()  # the stamp goes first, so a cut-short write is not reused
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == written


def test_ckpt_only_needs_a_directory(capsys):
    with pytest.raises(SystemExit):
        throughput.main([*TINY, "--ckpt-only"])
    assert "--ckpt-only writes the checkpoints into --ckpt-dir" in capsys.readouterr().err


def test_without_vllm_the_peer_cells_say_not_installed(tmp_path, capsys):
    assert throughput.main([*TINY, "--modes", "vllm,vllm-bi", "--vllm-site", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "vLLM not installed" in out
    assert out.count(f"| {peers.NOT_INSTALLED} |") == 6  # 2 modes x 2 batch limits + 2 batch-1 rows


def test_vllm_workers_get_the_same_workload_and_their_mode(tmp_path, capsys):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    work = tmp_path / "work"
    argv = [*TINY, "--modes", "vllm,vllm-bi", "--max-num-seqs", "2", "--vllm-site", str(site), "--ckpt-dir", str(work)]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.0-fake" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 2 | vLLM")]
    assert len(rows) == 2 and rows[0].split("|")[4].strip() == "1.00", rows  # vLLM default / itself
    for row in rows:
        assert float(row.split("|")[3]) > 0 and float(row.split("|")[5]) > 0, row
    # every worker saw the engine's own prompts (after a warm-up call on the first 4, then batch-1 calls)
    spec = argparse.Namespace(seed=0, prompt_len=[4, 9], gen_len=[2, 5], num_prompts=3)
    prompts, _ = throughput.workload(spec, tiny_qwen3_config().vocab_size)
    seen = sorted((work / "qwen3-tiny").glob("seen-*.jsonl"))
    assert len(seen) == 2  # one worker process per mode
    for f in seen:
        calls = [json.loads(line) for line in f.read_text().splitlines()]
        assert calls[1] == prompts  # calls[0] is the warm-up, the rest batch-1 decode
    # each timed run's steps from the step log: the warm-up's and the batch-1 calls' steps are outside its window
    head = out.index("Steps by batch size at batch limit 2")
    table = out[head:].split("\n\n")[1].splitlines()
    assert table[0] == "| steps | requests a step | vLLM default | vLLM VLLM_BATCH_INVARIANT=1 |", table
    rows = {tuple(c.strip() for c in ln.strip("|").split("|")[:2]): ln for ln in table[2:]}
    max_tokens = [p.max_tokens for p in throughput.workload(spec, tiny_qwen3_config().vocab_size)[1]]
    batches = [min(sum(n > i for n in max_tokens), 2) for i in range(1, max(max_tokens))]  # the fake's decode steps
    want = {("with prompt tokens", "2"), ("whole run", "-"), ("all steps", "2")}
    want |= {(kind, str(b)) for b in batches for kind in ("decode only", "all steps")}
    assert set(rows) == want, rows
    assert rows[("with prompt tokens", "2")].count("| 1 x ") == 2, rows  # its first step, in both modes
    assert rows[("decode only", "2")].count(f"| {batches.count(2)} x ") == 2, rows
    assert rows[("all steps", "2")].count(f"| {batches.count(2) + 1} x ") == 2, rows
    assert rows[("whole run", "-")].count(f"| {max(max_tokens)} steps, ") == 2, rows


def _fake_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return site


def _profile_rows(text: str) -> dict[str, list[str]]:
    """The profile table's rows by engine name: its cells."""
    head = text.index("| engine | batch | context |")
    rows = [ln for ln in text[head:].split("\n\n")[0].splitlines()[2:]]
    return {cells[0]: cells for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in rows)}


def test_vllm_profile_runs_in_process_at_vexacts_batch_and_context(tmp_path, capsys):
    """--profile-steps with vLLM: after the timed runs, a worker of its own per vLLM mode (the spec's ``profile``)
    gets VeXact's profile batch, context and prompts, steps an in-process engine core (the stand-in's scheduler is
    reachable only with VLLM_ENABLE_V1_MULTIPROCESSING=0, and its timed generate refuses that setting) until the batch
    decodes, and its row joins VeXact's in the results file's profile table."""
    work, out = tmp_path / "work", tmp_path / "r.md"
    argv = [*TINY, "--modes", "invariant,vllm", "--max-num-seqs", "2", "--profile-steps", "2", "--grpo-prompts", "0",
            "--vllm-site", str(_fake_site(tmp_path)), "--ckpt-dir", str(work), "--results-md", str(out)]  # fmt: skip
    assert throughput.main(argv) == 0
    capsys.readouterr()
    text = out.read_text()
    rows = _profile_rows(text)
    ours, theirs = rows["VeXact invariant"], rows["vLLM default"]
    # the same batch and context (1: the tiny workload's 14-token max_model_len leaves vLLM's draws no more room)
    assert theirs[1:3] == ours[1:3] == ["2", "1"], rows
    assert theirs[4] == "0.00", theirs  # no CUDA kernels on CPU
    assert "vLLM's rows: a vLLM engine of its own" in text and "Async scheduling: vLLM default: on." in text
    spec = json.loads((work / "vllm-2-profile.spec.json").read_text())
    assert spec["profile"] == {"batch": 2, "context": 1, "steps": 2} and spec["max_num_seqs"] == 2
    args = throughput.parse_args(argv)
    vocab = tiny_qwen3_config().vocab_size
    assert spec["prompts"] == throughput.profile_prompts(2, 1, vocab, args)  # VeXact's profiled prompts
    assert spec["seeds"] == [0, 1] and spec["max_tokens"] == [13, 13]  # max_model_len 14 - context 1
    res = json.loads((work / "vllm-2-profile.result.json").read_text())
    assert res["fill_steps"] == 3 and res["async_scheduling"] is True and res["batch_invariant"] is False
    assert list(res["buckets"]) == list(profiling.BUCKETS) and res["kernel_ms"] == 0.0
    assert res["host_gap_ms"] == res["step_ms"] > 0 and theirs[3] == f"{res['step_ms']:.2f}"
    # the timed spec has no profile, and the profile's own worker did not generate
    assert "profile" not in json.loads((work / "vllm-2.spec.json").read_text())
    assert len(list((work / "qwen3-tiny").glob("seen-*.jsonl"))) == 1


def test_a_vllm_profile_that_fails_leaves_a_cell_saying_why(tmp_path, monkeypatch, capsys):
    """One vLLM mode's profile worker raises: its cell says why, the other mode's row stands (without a VeXact
    profile: at the batch limit and the workload's context), the timed rows are whole, and the exit status is 1 as for
    any run that failed; --no-peer-profile starts no profile worker."""
    monkeypatch.setenv("FAKE_VLLM_FAIL_BI", "1")
    site, work, out = _fake_site(tmp_path), tmp_path / "work", tmp_path / "r.md"
    argv = [*TINY, "--modes", "vllm,vllm-bi", "--max-num-seqs", "2", "--profile-steps", "2", "--grpo-prompts", "0",
            "--vllm-site", str(site), "--ckpt-dir", str(work), "--results-md", str(out)]  # fmt: skip
    assert throughput.main(argv) == 1
    assert "profile of vllm-bi (2): failed (rc 1): RuntimeError: no queue in this build" in capsys.readouterr().err
    text = out.read_text()
    rows = _profile_rows(text)
    assert rows["vLLM default"][1:3] == ["2", "1"], rows
    failed = rows["vLLM VLLM_BATCH_INVARIANT=1"]
    assert failed[1].startswith("failed (rc 1): RuntimeError: no queue in this build (log "), failed
    assert failed[2:] == ["-"] * (4 + len(profiling.BUCKETS)), failed
    timed = [ln for ln in text.splitlines() if ln.startswith("| vLLM") and "tok/s" not in ln]
    assert len(timed) == 2 + 2 and all(float(ln.split("|")[2]) > 0 for ln in timed[:2]), timed

    out.unlink()
    assert throughput.main([*argv, "--no-peer-profile"]) == 0
    assert "| engine | batch | context |" not in out.read_text()
    spec_times = {f.name: f.stat().st_mtime_ns for f in work.glob("*-profile.spec.json")}
    assert throughput.main([*argv, "--no-peer-profile"]) == 0
    assert {f.name: f.stat().st_mtime_ns for f in work.glob("*-profile.spec.json")} == spec_times


def test_moonlight_family_rows_have_peer_columns(capsys):
    """A DeepSeek-V3 shape (Moonlight's family; here the tiny one on CPU): VeXact invariant and fast rows, the vLLM
    cells (not installed here) and an HF generate row, and the KV bytes of the expanded MLA cache."""
    argv = [*TINY, "--models", "tiny-deepseek", "--modes", "invariant,fast,vllm,hf", "--grpo-prompts", "0",
            "--hf-prompts", "2", "--hf-new-tokens", "3"]  # fmt: skip
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert "## deepseek_v3 tiny-deepseek-shaped" in out and "Qwen3 shapes only" not in out
    table = [ln for ln in out.splitlines() if ln.startswith("| ") and "---" not in ln and "engine |" not in ln
             and "requests a step |" not in ln]  # fmt: skip
    # 2 backends x (2 batch limits + the batch-1 step + the 2 batch limits' step-time split)
    assert sum("VeXact" in ln for ln in table) == 10
    head = out.index("| batch limit | engine | decode-only steps")
    split = [ln.split(" | ") for ln in out[head:].split("\n\n")[0].splitlines()[2:]]
    assert len(split) == 4 and all(int(row[2]) > 0 and int(row[4]) > 0 for row in split), split  # both kinds ran
    assert sum(f"| vLLM default | {peers.NOT_INSTALLED} |" in ln for ln in table) == 3  # 2 batch limits + batch 1
    hf_rows = [ln for ln in table if "HF generate" in ln]
    assert len(hf_rows) == 2 and hf_rows[0].startswith("| 2 (one batch, 3 new tokens) | HF generate"), hf_rows
    assert float(hf_rows[0].split("|")[3]) > 0 and float(hf_rows[1].split("|")[2]) >= 0, hf_rows
    cfg = throughput.make_model("tiny-deepseek", 2).config
    heads, k, v = cfg.kv_cache_dims
    assert peers.kv_bytes_per_token(cfg) == 2 * heads * (k + v) * 2


def test_vllm_workers_load_the_moe_families(tmp_path, capsys):
    """The peer path for the MoE families (the dense ones differ only in the checkpoint, which
    test_hf_checkpoint_holds_the_same_weights checks for each): the checkpoint the worker gets carries the family's
    architecture (the stand-in vLLM checks it against the model_type) and each family gets its vLLM row and ratio."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    work = tmp_path / "work"
    shapes = ["tiny-qwen3-moe", "tiny-deepseek"]
    argv = [*TINY, "--models", ",".join(shapes), "--modes", "vllm", "--max-num-seqs", "2", "--grpo-prompts", "0",
            "--decode-steps", "1", "--vllm-site", str(site), "--ckpt-dir", str(work)]  # fmt: skip
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    for shape in shapes:
        family = throughput.SHAPES[shape][0]
        section = out[out.index(f"## {family} {shape}-shaped") :].split("\n## ")[0]
        rows = [ln for ln in section.splitlines() if ln.startswith("| 2 | vLLM default |")]
        assert len(rows) == 1 and rows[0].split("|")[4].strip() == "1.00", (shape, section)
        assert (work / f"{family}-{shape}" / "config.json").exists()


def test_every_family_has_a_real_shape_and_a_config():
    families = {family for family, _ in throughput.SHAPES.values()}
    assert families == set(ARCHITECTURES)
    assert throughput.SHAPES["qwen3-30b-a3b"][0] == "qwen3_moe" and throughput.SHAPES["moonlight"][0] == "deepseek_v3"
    with torch.device("meta"):
        for name in ("8b", "qwen3-30b-a3b", "moonlight", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b-v0.1"):
            family, sizes = throughput.SHAPES[name]
            cfg = throughput.CONFIGS[family](**sizes)
            assert cfg.model_type == family and cfg.num_hidden_layers == sizes["num_hidden_layers"], name
    assert throughput.SHAPES["qwen3-30b-a3b"][1]["num_hidden_layers"] == 48
    assert throughput.SHAPES["moonlight"][1]["num_hidden_layers"] == 27
    assert throughput.SHAPES["8b"] == ("qwen3", QWEN3_SHAPES["qwen3-8b"])


def test_block_size_reaches_every_vexact_engine(monkeypatch, capsys):
    """``--block-size 128``: the throughput engines and the batch-1 engine run 128-token pages (the batch-1 engine's
    KV sized in those pages), and the report says so; a page size under 1 is refused before any model is built."""
    made = []

    class Recording(throughput.LLM):
        def __init__(self, *args, **kw):
            made.append(kw)
            super().__init__(*args, **kw)

    monkeypatch.setattr(throughput, "LLM", Recording)
    argv = [*TINY, "--modes", "invariant", "--grpo-prompts", "0", "--max-num-seqs", "2", "--block-size", "128"]
    assert throughput.main(argv) == 0
    assert "VeXact's KV pages of 128 tokens" in capsys.readouterr().out
    assert len(made) == 2 and all(kw["block_size"] == 128 for kw in made)
    batch1 = [kw for kw in made if kw["max_num_seqs"] == 1]
    assert len(batch1) == 1 and batch1[0]["num_kv_blocks"] == 2 * -(-batch1[0]["max_model_len"] // 128)
    with pytest.raises(SystemExit):
        throughput.main([*TINY, "--block-size", "0"])
    assert "--block-size: tokens per KV page must be a positive integer, got 0" in capsys.readouterr().err


def test_the_draw_in_graph_mode_runs_beside_invariant_and_is_checked_against_it(capsys):
    """``--modes invariant,invariant-draw``: both rows, and a line per batch limit saying whether their tokens and
    logprobs are equal (on CPU no step runs padded, so the draw never leaves sample_rows_on_device: the smoke of the
    wiring)."""
    argv = [*TINY, "--modes", "invariant,invariant-draw", "--grpo-prompts", "0"]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert sum(ln.startswith("| 2 | VeXact invariant, draw in the decode graph |") for ln in out.splitlines()) == 2
    assert out.count("logprobs (torch.equal, every request): yes") == 2


@pytest.mark.parametrize("flag, want", [(None, 0), ("none", None)])
def test_vllm_returns_the_drawn_tokens_logprobs_unless_told_not_to(tmp_path, capsys, monkeypatch, flag, want):
    """As verl's vLLM rollout asks (logprobs=0) by default: the spec carries it, the worker checks that each token's
    logprob came back (a build that drops them fails the cell, naming the count), and the results say so."""
    work = tmp_path / "work"
    argv = [*TINY, "--modes", "vllm", "--max-num-seqs", "2", "--vllm-site", str(_fake_site(tmp_path)),
            "--ckpt-dir", str(work), *(["--vllm-logprobs", flag] if flag else [])]  # fmt: skip
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert json.loads((work / "vllm-2.spec.json").read_text())["logprobs"] == want
    assert json.loads((work / "vllm-2.result.json").read_text())["logprobs"] == want
    words = "each drawn token's logprob (logprobs=0" if want == 0 else "vLLM returns no logprobs"
    assert words in out
    if want is None:
        return
    monkeypatch.setenv("FAKE_VLLM_NO_LOGPROBS", "1")
    assert throughput.main(argv) == 1  # a failed cell: exit status 1
    out = capsys.readouterr().out
    assert "vLLM returned logprobs for 0 of" in out, out
