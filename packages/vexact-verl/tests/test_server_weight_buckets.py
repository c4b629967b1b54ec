"""The server's packed-bucket loading (the engine side of the adapter's CUDA IPC path), on CPU buffers: buckets load
in place and the server serves the new weights; a bad bucket or buffer index is refused by name and the server keeps
serving the old weights. (The IPC handles themselves need CUDA: tests/test_verl_rollout_gpu.py.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from vexact_models import BucketPacker, CheckpointError, default_checkpoint, load_model, random_model

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")


def test_server_loads_packed_buckets_and_refuses_bad_ones():
    from vexact_trainer import Actor, iter_weights
    from vexact_verl.server import ServerSettings, VexactServer

    path = default_checkpoint()
    settings = ServerSettings(model_path=str(path), max_model_len=48, prompt_length=16, response_length=8,
                              engine={"device": "cpu", "num_kv_blocks": 32, "block_size": 4})  # fmt: skip
    server = VexactServer(settings)
    new = random_model(load_model(path).config, seed=9)
    packer = BucketPacker(8 << 10, "cpu")
    buckets = [(b.index, b.specs, b.nbytes, packer.buffers[b.index][: b.nbytes].clone())
               for b in packer.buckets(iter_weights(new))]  # fmt: skip
    sampling = {"temperature": 1.0, "max_tokens": 6, "logprobs": True, "seed": 1}

    async def scenario():
        await server.launch_server()
        before = await server.generate([257, 10, 11], dict(sampling), "a")
        with pytest.raises(ValueError, match="weight buffer 0 is not open"):
            await server.load_weight_bucket(0, buckets[0][1], buckets[0][2])
        server._weight_buffers = [torch.zeros(8 << 10, dtype=torch.uint8) for _ in range(2)]  # what IPC opens
        index, specs, nbytes, data = buckets[0]
        server._weight_buffers[index][:nbytes] = data
        bad = [specs[0]._replace(dtype=torch.float32), *specs[1:]]
        with pytest.raises(CheckpointError, match="dtype torch.float32"):
            await server.load_weight_bucket(index, bad, nbytes)
        again = await server.generate([257, 10, 11], dict(sampling), "b")  # unchanged, still serving
        assert again.token_ids == before.token_ids and again.log_probs == before.log_probs
        loaded = 0
        for index, specs, nbytes, data in buckets:
            server._weight_buffers[index][:nbytes] = data
            loaded += await server.load_weight_bucket(index, specs, nbytes)
        await server.close_weight_buffers()
        after = await server.generate([257, 10, 11], dict(sampling), "c")
        return loaded, after

    loaded, after = asyncio.run(scenario())
    assert loaded == len(server.engine.weight_names())
    want = Actor(new).compute_log_probs([[257, 10, 11]], [after.token_ids], 1.0).logprobs[0]
    assert torch.equal(torch.tensor(after.log_probs, dtype=torch.float32), want)
