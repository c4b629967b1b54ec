"""The vLLM plugin of the peer runs (examples/verify/vllm_plugin): vLLM finds it through its entry point once the
folder is on PYTHONPATH, and with it a loader built as vLLM 0.24.0's gpt-oss loader for bf16 weights (expert
parameters under ``mlp.experts.routed_experts.``, looked up under ``mlp.experts.``) loads every expert tensor into
the parameter it belongs to, where without it the loader stops at ``KeyError: 'layers.0.mlp.experts.w2_weight'`` as
vLLM did on an H200. The stand-in below has vLLM 0.24.0's lookups, not its code; vLLM itself runs only on a GPU
machine (``benchmarks/throughput.py --models gpt-oss-20b``, ``PAIR=gptoss-1k examples/verify/run_pair.sh``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples/verify/vllm_plugin"
E, H, I = 4, 6, 5  # experts, hidden, intermediate  # noqa: E741


def _plugin():
    spec = importlib.util.spec_from_file_location("vexact_vllm_plugin_under_test", PLUGIN / "vexact_vllm_plugin.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * I, H), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, I), requires_grad=False)
        self.w13_bias = torch.nn.Parameter(torch.zeros(E, 2 * I), requires_grad=False)
        self.w2_bias = torch.nn.Parameter(torch.zeros(E, H), requires_grad=False)


def _stand_in_model(routed: bool) -> type[torch.nn.Module]:
    """A gpt-oss model with vLLM 0.24.0's parameter layout (``routed``: under ``routed_experts``, as its fused MoE
    keeps them) and its bf16 loader's lookups: an expert weight by its name as mapped from the checkpoint, a KeyError
    where the model has no such parameter; other names skipped where absent."""

    class GptOssModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.router = torch.nn.Linear(H, E, bias=False)
            if routed:
                layer.mlp.experts = torch.nn.Module()
                layer.mlp.experts.routed_experts = _Experts()
            else:
                layer.mlp.experts = _Experts()
            self.layers = torch.nn.ModuleList([layer])

        def _load_weights_other(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, mapping):
            params_dict = dict(self.named_parameters())
            loaded = set()
            for name, weight in weights:
                if any(k in name for k in (".w13_weight", ".w2_weight")):
                    params_dict[name].copy_(weight.permute(0, 2, 1))
                elif any(k in name for k in (".w13_bias", ".w2_bias")):
                    params_dict[name].copy_(weight)
                elif name in params_dict:
                    params_dict[name].data.copy_(weight)
                else:
                    continue
                loaded.add(name)
            return loaded

    return GptOssModel


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 gpt-oss expert tensors as vLLM hands them to the loader (names after its hf_to_vllm_mapper)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.mlp.experts.w13_weight": torch.randn(E, H, 2 * I, generator=g),
        "layers.0.mlp.experts.w2_weight": torch.randn(E, I, H, generator=g),
        "layers.0.mlp.experts.w13_bias": torch.randn(E, 2 * I, generator=g),
        "layers.0.mlp.experts.w2_bias": torch.randn(E, H, generator=g),
        "layers.0.mlp.router.weight": torch.randn(E, H, generator=g),
    }


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.model_executor.models.gpt_oss`` as a module holding the stand-in (set ``.GptOssModel`` per test)."""
    names = ["vllm", "vllm.model_executor", "vllm.model_executor.models", "vllm.model_executor.models.gpt_oss"]
    mods = [types.ModuleType(n) for n in names]
    for parent, child, name in zip(mods, mods[1:], names[1:], strict=False):
        setattr(parent, name.rsplit(".", 1)[1], child)
    for name, mod in zip(names, mods, strict=True):
        monkeypatch.setitem(sys.modules, name, mod)
    return mods[-1]


def _load(model: torch.nn.Module, ckpt: dict[str, torch.Tensor]) -> set[str]:
    return model._load_weights_other(1, 0, 1, 0, iter(ckpt.items()), [])  # positional, as vLLM calls it


def test_without_the_plugin_the_bf16_loader_stops_at_the_first_expert_weight(fake_vllm):
    fake_vllm.GptOssModel = _stand_in_model(routed=True)
    with pytest.raises(KeyError, match="layers.0.mlp.experts.w13_weight"):
        _load(fake_vllm.GptOssModel(), _checkpoint())


def test_with_the_plugin_every_expert_tensor_lands_in_its_routed_parameter(fake_vllm):
    fake_vllm.GptOssModel = _stand_in_model(routed=True)
    original = fake_vllm.GptOssModel._load_weights_other
    plugin = _plugin()
    plugin.register()
    plugin.register()  # vLLM may call a plugin more than once in a process: one wrapper
    assert fake_vllm.GptOssModel._load_weights_other.__wrapped__ is original
    model, ckpt = fake_vllm.GptOssModel(), _checkpoint()
    loaded = _load(model, ckpt)
    params = dict(model.named_parameters())
    assert loaded == set(params)  # every parameter, by the model's own names
    routed = "layers.0.mlp.experts.routed_experts."
    assert torch.equal(params[routed + "w13_weight"], ckpt["layers.0.mlp.experts.w13_weight"].permute(0, 2, 1))
    assert torch.equal(params[routed + "w2_weight"], ckpt["layers.0.mlp.experts.w2_weight"].permute(0, 2, 1))
    assert torch.equal(params[routed + "w13_bias"], ckpt["layers.0.mlp.experts.w13_bias"])
    assert torch.equal(params[routed + "w2_bias"], ckpt["layers.0.mlp.experts.w2_bias"])
    assert torch.equal(params["layers.0.mlp.router.weight"], ckpt["layers.0.mlp.router.weight"])
    # keywords reach it too (the weights by name)
    model = fake_vllm.GptOssModel()
    model._load_weights_other(1, 0, 1, 0, weights=iter(_checkpoint(1).items()), mapping=[])
    assert torch.equal(
        model.layers[0].mlp.experts.routed_experts.w2_bias, _checkpoint(1)["layers.0.mlp.experts.w2_bias"]
    )


def test_on_a_vllm_that_finds_the_names_the_plugin_changes_none(fake_vllm):
    fake_vllm.GptOssModel = _stand_in_model(routed=False)
    _plugin().register()
    model, ckpt = fake_vllm.GptOssModel(), _checkpoint()
    assert _load(model, ckpt) == set(ckpt)
    assert torch.equal(model.layers[0].mlp.experts.w2_bias, ckpt["layers.0.mlp.experts.w2_bias"])


def test_routed_name_maps_only_names_the_model_lacks():
    plugin = _plugin()
    params = {"layers.3.mlp.experts.routed_experts.w2_weight", "layers.3.mlp.router.weight", "layers.3.mlp.experts.x"}
    assert (
        plugin.routed_name("layers.3.mlp.experts.w2_weight", params) == "layers.3.mlp.experts.routed_experts.w2_weight"
    )
    assert plugin.routed_name("layers.3.mlp.experts.x", params) == "layers.3.mlp.experts.x"  # a parameter as it is
    assert plugin.routed_name("layers.3.mlp.router.weight", params) == "layers.3.mlp.router.weight"
    assert plugin.routed_name("layers.3.mlp.experts.w9", params) == "layers.3.mlp.experts.w9"  # neither: vLLM decides


def test_without_vllm_register_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    _plugin().register()


def test_vllm_finds_the_entry_point_once_the_folder_is_on_the_path():
    code = (
        "from importlib.metadata import entry_points\n"
        "eps = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'vexact_gpt_oss_bf16']\n"
        "f = eps[0].load()\n"
        "print(len(eps), f.__module__, f.__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{PLUGIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "vexact_vllm_plugin", "register"]


def test_the_peers_vllm_processes_get_the_plugin(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv("PYTHONPATH", "/x/fa4site:/y")
    env = peers._env("/tmp/vllmsite", False)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(PLUGIN), "/tmp/vllmsite", "/y"]


@pytest.mark.parametrize(("pair", "plugin"), [("gptoss-1k", True), ("moe-1k", False), ("dense-1k", False)])
def test_run_pair_puts_the_plugin_on_the_gpt_oss_vllm_arm(tmp_path, pair, plugin):
    err = subprocess.run(
        ["bash", "examples/verify/run_pair.sh", str(tmp_path), "vllm"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "DRY_RUN": "1", "TAG": "cpu", "PAIR": pair, "PYTHONPATH_VLLM": "/v", "PYTHONPATH_FA4": "",
             "ACTOR_ATTN": "eager"},  # no FA4 here: gpt-oss's arm refuses to fall back unless told
        check=True,
    ).stderr  # fmt: skip
    note = next(ln for ln in err.splitlines() if ln.startswith(f"== cpu-{pair}-vllm: "))
    front = note.split("PYTHONPATH in front: ")[1].split(":")
    assert (str(PLUGIN) in front) == plugin, note
    if plugin:
        assert front.index(str(PLUGIN)) < front.index("/v")  # before vLLM's folder


@pytest.fixture
def fake_scheduler(monkeypatch):
    """``vllm.v1.core.sched.scheduler.Scheduler`` (and ``async_scheduler.AsyncScheduler``, which inherits
    ``schedule`` as vLLM's does) whose ``schedule`` returns the token counts it was built with, as a
    ``SchedulerOutput``'s ``num_scheduled_tokens``."""
    names = ["vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
             "vllm.v1.core.sched.async_scheduler"]  # fmt: skip
    mods = [types.ModuleType(n) for n in names]
    for name, mod in zip(names, mods, strict=True):
        monkeypatch.setitem(sys.modules, name, mod)
        if "." in name:
            setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], mod)

    class Scheduler:
        def __init__(self, steps):
            self.steps = list(steps)

        def schedule(self):
            return types.SimpleNamespace(num_scheduled_tokens=self.steps.pop(0))

    class AsyncScheduler(Scheduler):
        pass

    mods[4].Scheduler, mods[5].AsyncScheduler = Scheduler, AsyncScheduler
    return Scheduler, AsyncScheduler


def test_the_step_log_writes_a_line_per_schedule_call(fake_scheduler, monkeypatch, tmp_path):
    scheduler, async_scheduler = fake_scheduler
    plugin = _plugin()
    log = tmp_path / "steps.log"
    monkeypatch.setenv(plugin.STEP_LOG, str(log))
    plugin.register_step_log()
    plugin.register_step_log()  # called again in the same process: one wrapper
    assert scheduler.schedule.__wrapped__.__name__ == "schedule"
    assert not hasattr(scheduler.schedule.__wrapped__, "__wrapped__")
    steps = [{"a": 1, "b": 1, "c": 300}, {"a": 1, "b": 1, "c": 1}, {}]
    sched = async_scheduler(steps)
    outs = [sched.schedule() for _ in range(3)]
    assert [o.num_scheduled_tokens for o in outs] == [{"a": 1, "b": 1, "c": 300}, {"a": 1, "b": 1, "c": 1}, {}]
    lines = [ln.split() for ln in log.read_text().splitlines()]  # line-buffered: there before the process ends
    assert [(int(r), int(p)) for _, r, p in lines] == [(3, 300), (3, 0), (0, 0)]
    times = [float(t) for t, _, _ in lines]
    assert times == sorted(times)


def test_without_the_step_log_variable_schedule_is_left_alone(fake_scheduler, monkeypatch):
    scheduler, _ = fake_scheduler
    plugin = _plugin()
    monkeypatch.delenv(plugin.STEP_LOG, raising=False)
    original = scheduler.schedule
    plugin.register_step_log()
    assert scheduler.schedule is original
