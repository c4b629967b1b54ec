"""The server's account of a generation phase (``GenPhase``): from ready to sleep, the time inside engine steps, the
requests, steps and tokens, logged at sleep and kept for ``get_stats``; on CPU with the bundled tiny checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from vexact_models import default_checkpoint

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")


def _phase_of_three_requests(num_kv_blocks: int, max_model_len: int, prompt_length: int, caplog=None):
    """``(server, outputs, stats)``: a CPU server with a cache of ``num_kv_blocks`` pages of 4 tokens answers three
    requests of 6 tokens, is put to sleep (logged at INFO into ``caplog`` where given), its stats read, and woken."""
    from vexact_verl.server import ServerSettings, VexactServer

    engine = {"device": "cpu", "num_kv_blocks": num_kv_blocks, "block_size": 4}
    settings = ServerSettings(
        model_path=str(default_checkpoint()), max_model_len=max_model_len, prompt_length=prompt_length,
        response_length=8, engine=engine,
    )  # fmt: skip
    server = VexactServer(settings)
    sampling = {"temperature": 1.0, "max_tokens": 6, "seed": 1, "ignore_eos": True}

    async def scenario():
        await server.launch_server()
        outs = await asyncio.gather(*(server.generate([257, 10 + i], dict(sampling), f"r{i}") for i in range(3)))
        if caplog is None:
            await server.sleep()
        else:
            with caplog.at_level(logging.INFO, logger="vexact_verl"):
                await server.sleep()
        stats = await server.get_stats()
        await server.wake_up()
        return outs, stats

    return (server, *asyncio.run(scenario()))


def test_a_generation_phase_is_accounted_for_at_sleep(caplog, monkeypatch, tmp_path):
    from vexact_verl.server import GenPhase

    monkeypatch.setenv("VEXACT_GEN_PHASE_LOG", str(tmp_path / "phases.jsonl"))
    server, outs, stats = _phase_of_three_requests(num_kv_blocks=32, max_model_len=48, prompt_length=16, caplog=caplog)
    assert sum(len(o.token_ids) for o in outs) == 18
    assert stats["phase_requests"] == 3 and stats["phase_tokens"] == 18
    assert stats["phase_steps"] >= 6 and stats["phase_steps"] == stats["steps"]
    assert 0 < stats["phase_engine_s"] <= stats["phase_wall_s"]
    assert 0 < stats["phase_engine_share"] <= 1.0 + 1e-6
    parts = ("to_first_request_s", "first_to_last_answer_s", "after_last_answer_s")
    assert sum(stats[f"phase_{k}"] for k in parts) == pytest.approx(stats["phase_wall_s"])
    assert "generation phase" in caplog.text and "3 requests" in caplog.text and "18 tokens" in caplog.text
    # occupancy: the three requests ran together, in a cache of 32 pages of 4 tokens, none preempted
    assert stats["phase_peak_running"] == 3 and stats["phase_kv_tokens"] == 128 and stats["phase_preemptions"] == 0
    assert "at most 3 running, KV cache 128 tokens, 0 preemptions" in caplog.text
    # a phase without requests (woken and put to sleep again) keeps the last one
    assert server.last_phase["requests"] == 3 and isinstance(server._phase, GenPhase)
    lines = (tmp_path / "phases.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["tokens"] == 18 and json.loads(lines[0])["replica"] == 0


def test_a_phase_names_the_preemptions_of_a_small_cache(tmp_path):
    """A cache too small for the requests' growth (3 prompts fit its 4 pages, their responses do not): the phase
    counts the preemptions and its KV capacity."""
    _, outs, stats = _phase_of_three_requests(num_kv_blocks=4, max_model_len=16, prompt_length=4)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert stats["phase_kv_tokens"] == 16 and stats["phase_preemptions"] > 0, stats
    assert 1 <= stats["phase_peak_running"] <= 3, stats
