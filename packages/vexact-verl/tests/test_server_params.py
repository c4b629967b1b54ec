"""verl's sampling dict -> SamplingParams: a NaN or infinite value is refused by name (no verl needed)."""

from __future__ import annotations

import asyncio

import pytest

from vexact_verl.server import ServerSettings, to_engine_params

SETTINGS = ServerSettings(model_path="x", max_model_len=24, prompt_length=16, response_length=8)
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "sampling,message",
    [
        ({"temperature": NAN}, r"temperature must be a finite number >= 0, got nan"),
        ({"temperature": INF}, r"temperature must be a finite number >= 0, got inf"),
        ({"temperature": -INF}, r"temperature must be a finite number >= 0, got -inf"),
        ({"temperature": "nan"}, r"temperature must be a finite number >= 0, got nan"),
        ({"temperature": None}, r"sampling param temperature must be a finite float, got None"),
        ({"top_p": NAN}, r"top_p must be a finite number in \(0, 1\], got nan"),
        ({"top_p": INF}, r"top_p must be a finite number in \(0, 1\], got inf"),
        ({"top_k": NAN}, r"sampling param top_k must be a finite int, got nan"),
        ({"top_k": INF}, r"sampling param top_k must be a finite int, got inf"),
        ({"max_tokens": NAN}, r"sampling param max_tokens must be a finite int, got nan"),
        ({"max_new_tokens": INF}, r"sampling param max_tokens must be a finite int, got inf"),
    ],
)
def test_non_finite_sampling_values_are_refused_by_name(sampling, message):
    with pytest.raises(ValueError, match=message):
        to_engine_params(sampling, prompt_len=4, settings=SETTINGS)


def test_finite_values_still_translate():
    p, lp = to_engine_params({"temperature": 0.0, "top_p": 0.5, "top_k": 3.0, "logprobs": True}, 4, SETTINGS)
    assert (p.temperature, p.top_p, p.top_k, p.greedy, lp) == (0.0, 0.5, 3, True, True)


def test_server_refuses_a_bad_request_to_its_caller_and_keeps_serving():
    """A NaN temperature or a bad prompt raises to verl naming the request; nothing of it stays in the server."""
    pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
    from vexact_models import default_checkpoint
    from vexact_verl.server import VexactServer

    settings = ServerSettings(
        model_path=str(default_checkpoint()),
        max_model_len=24,
        prompt_length=16,
        response_length=8,
        engine={"device": "cpu", "num_kv_blocks": 16, "block_size": 4},
    )
    server = VexactServer(settings)

    async def scenario():
        await server.launch_server()
        with pytest.raises(ValueError, match=r"request nan-1: temperature must be a finite number >= 0, got nan"):
            await server.generate([257, 10], {"temperature": NAN, "max_tokens": 2}, "nan-1")
        with pytest.raises(ValueError, match=r"request nan-2: sampling param top_k must be a finite int, got nan"):
            await server.generate([257, 10], {"top_k": NAN, "max_tokens": 2}, "nan-2")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await server.generate([257, 99999], {"max_tokens": 2}, "oov")
        assert not server._futures and not server._prompts and not server._in_engine
        out = await server.generate([257, 10], {"temperature": 1.0, "max_tokens": 2, "logprobs": True}, "good")
        assert 1 <= len(out.token_ids) <= 2 and len(out.log_probs) == len(out.token_ids)
        server._loop_task.cancel()

    asyncio.run(scenario())
