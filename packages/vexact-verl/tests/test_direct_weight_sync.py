"""The single-copy colocated path through the verl glue, on CPU: the server hands out its engine's packed weight
buffers and table, admits no request while a trainer writes into them and serves the new weights after; the adapter
takes that path when it shares the server's GPU and the engine's weights are packed, falls back to bucket buffers
(generator untouched) when they are not, and leaves the server serving after a refused tensor. (On CPU the server's
buffers stand for the CUDA IPC handles; the handles themselves: contracts/test_weight_sync.py on a GPU.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from verl.workers.config import RolloutConfig  # noqa: E402

from vexact_models import CheckpointError, DirectWriter, default_checkpoint, load_model, random_model  # noqa: E402
from vexact_trainer import Actor, iter_weights  # noqa: E402
from vexact_verl.rollout import ServerAdapter  # noqa: E402
from vexact_verl.server import ServerSettings, VexactServer  # noqa: E402

SAMPLING = {"temperature": 1.0, "max_tokens": 6, "logprobs": True, "seed": 1}
PROMPT = [257, 10, 11]


def _server(**engine) -> VexactServer:
    settings = ServerSettings(model_path=str(default_checkpoint()), max_model_len=48, prompt_length=16,
                              response_length=8, engine={"device": "cpu", "num_kv_blocks": 32, "block_size": 4,
                                                         **engine})  # fmt: skip
    return VexactServer(settings)


def _new_weights():
    return random_model(load_model(default_checkpoint()).config, seed=9)


def _trainer_logprobs(model, out) -> torch.Tensor:
    return Actor(model).compute_log_probs([PROMPT], [out.token_ids], 1.0).logprobs[0]


def test_server_serves_the_written_weights_and_holds_requests_meanwhile():
    server, new = _server(), _new_weights()

    async def scenario():
        await server.launch_server()
        begun = await server.begin_direct_weight_sync(None)
        assert begun["keep_open"] is False and begun["reused_memory"] is False  # hybrid: the engine sleeps
        writer = DirectWriter()
        writer.open(begun["table"], begun["handles"])
        waiting = asyncio.ensure_future(server.generate(PROMPT, dict(SAMPLING), "during"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no request reaches the engine while its weights are being written
        written = writer.write(iter_weights(new))
        loaded = await server.finish_direct_weight_sync(begun["key"], begun["table"].mask(written))
        out = await waiting
        again = await server.begin_direct_weight_sync(begun["key"])  # this key is open: no table, no new handles
        assert again["key"] == begun["key"] and again["table"] is None and again["handles"] is None
        assert await server.finish_direct_weight_sync(again["key"], None) == 0  # a failed sync loads nothing ...
        after = await server.generate(PROMPT, dict(SAMPLING), "after")  # ... and the server serves again
        return loaded, out, after

    loaded, out, after = asyncio.run(scenario())
    assert loaded == len(server.engine.weight_names())
    assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float32), _trainer_logprobs(new, out))
    assert after.token_ids == out.token_ids and after.log_probs == out.log_probs


class _Remote:
    """A stand-in for the server's Ray actor handle (``handle.method.remote(...)``), calling the server in-process."""

    def __init__(self, server, calls: list):
        self._server, self._calls = server, calls

    def __getattr__(self, name):
        fn = getattr(self._server, name)
        calls = self._calls

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                calls.append(name)
                result = fn(*args, **kwargs)
                if asyncio.iscoroutine(result):
                    return result

                async def value():
                    return result

                return value()

        return Method


def _adapter(monkeypatch, server, calls):
    """A ServerAdapter whose worker shares the server's 'GPU' (the device check is what decides the IPC paths)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("vexact_models.device_uuid", lambda *a: "GPU-same")
    monkeypatch.setattr(VexactServer, "weight_sync_device", lambda self: "GPU-same")
    monkeypatch.setattr(VexactServer, "attention_impl", lambda self: "triton")
    monkeypatch.setattr("vexact_models.weight_sync.open_ipc_handle", lambda handle, device=None: handle)
    config = RolloutConfig(name="vexact", tensor_model_parallel_size=1, prompt_length=16, response_length=8,
                           max_num_seqs=4)  # fmt: skip
    adapter = ServerAdapter(config, None)
    adapter.server_handle = _Remote(server, calls)
    adapter._attention_checked = True
    return adapter


def test_the_adapter_writes_directly_into_packed_weights(monkeypatch):
    server, new, calls = _server(), _new_weights(), []
    adapter = _adapter(monkeypatch, server, calls)

    async def scenario():
        await server.launch_server()
        await adapter.update_weights(((n, p.detach()) for n, p in new.named_parameters()), global_steps=3)
        return await server.generate(PROMPT, dict(SAMPLING), "a")

    out = asyncio.run(scenario())
    assert adapter.weight_sync_path == "direct"
    assert "load_weight_bucket" not in calls and "update_weights" not in calls
    assert adapter._direct.key is None  # closed after the sync: the engine may sleep and free its weights
    assert server.global_steps == 3
    assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float32), _trainer_logprobs(new, out))


def test_the_adapter_falls_back_to_buckets_without_packed_weights(monkeypatch):
    server, new, calls = _server(pack_weights=False), _new_weights(), []
    adapter = _adapter(monkeypatch, server, calls)
    taken = []

    async def buckets(self, server_handle, weights):
        taken.append(len(list(weights)))  # the generator reaches the bucket path untouched
        return taken[-1]

    monkeypatch.setattr(ServerAdapter, "_update_weights_ipc", buckets)

    async def scenario():
        await server.launch_server()
        await adapter.update_weights((n, p.detach()) for n, p in new.named_parameters())

    asyncio.run(scenario())
    assert adapter.weight_sync_path == "buckets" and taken == [len(list(new.named_parameters()))]


def test_a_refused_tensor_leaves_the_server_serving(monkeypatch):
    server, new, calls = _server(), _new_weights(), []
    adapter = _adapter(monkeypatch, server, calls)

    async def scenario():
        await server.launch_server()
        before = await server.generate(PROMPT, dict(SAMPLING), "before")
        bad = [*((n, p.detach()) for n, p in new.named_parameters()), ("model.layers.9.mlp.up_proj.weight", None)]
        with pytest.raises(CheckpointError, match="model.layers.9.mlp.up_proj.weight: the engine has no tensor"):
            await adapter.update_weights(iter(bad))
        again = await asyncio.wait_for(server.generate(PROMPT, dict(SAMPLING), "again"), 30)
        return before, again

    before, again = asyncio.run(scenario())
    assert again.token_ids == before.token_ids and again.log_probs == before.log_probs  # nothing was written
    assert calls.count("finish_direct_weight_sync") == 1 and adapter._direct.key is None
