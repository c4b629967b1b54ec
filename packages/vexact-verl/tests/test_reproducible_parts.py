"""The two pieces that make a verl run a function of its config and data (no Ray, no job: milliseconds).

- :class:`vexact_verl.agent_loop.SeededSingleTurnAgentLoop` gives each request a seed from (rollout.seed, step,
  dataset index, session_id, prompt), never from arrival order.
- :class:`vexact_verl.replay.OrderedReplayBuffer` lists a step's trajectories in dataloader order whatever order they
  finished in, and refuses a batch with a failed group.

The end-to-end check (two runs, and a resumed run, bitwise) is ``test_verl_grpo_cpu.py``.
"""

from __future__ import annotations

import asyncio
import types

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
pytest.importorskip("transfer_queue", reason="verl's TransferQueue is not installed")

from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # noqa: E402
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop  # noqa: E402

from vexact_verl import register  # noqa: E402
from vexact_verl import replay as replay_mod  # noqa: E402
from vexact_verl.agent_loop import AGENT_LOOP_NAME, SeededSingleTurnAgentLoop, sample_seed  # noqa: E402
from vexact_verl.replay import OrderedReplayBuffer  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 3+4?"}]


def test_sample_seed_is_a_function_of_the_sample():
    base = sample_seed(42, 3, 7, 1, MESSAGES)
    assert base == sample_seed(42, 3, 7, 1, [dict(m) for m in MESSAGES])  # same sample, same seed
    assert 0 <= base < 2**63
    other_prompt = [{"role": "user", "content": "2+2?"}]
    others = [sample_seed(*args) for args in ((43, 3, 7, 1, MESSAGES), (42, 4, 7, 1, MESSAGES), (42, 3, 8, 1, MESSAGES),
                                              (42, 3, 7, 2, MESSAGES), (42, 3, 7, 1, other_prompt))]  # fmt: skip
    assert len({base, *others}) == 1 + len(others)


def seeded_loop(monkeypatch):
    """The agent loop with verl's single-turn ``run`` replaced by a recorder of what it would send."""
    sent = []

    async def record(self, sampling_params, **kwargs):
        sent.append(sampling_params)

    monkeypatch.setattr(SingleTurnAgentLoop, "run", record)
    loop = object.__new__(SeededSingleTurnAgentLoop)  # verl builds it through Hydra with its worker's handles
    loop.rollout_config = types.SimpleNamespace(seed=42)
    return loop, sent


def test_agent_loop_sends_the_sample_seed(monkeypatch):
    register()
    assert _agent_loop_registry[AGENT_LOOP_NAME]["_target_"].endswith("SeededSingleTurnAgentLoop")
    loop, sent = seeded_loop(monkeypatch)
    sample = dict(global_steps=3, index=7, raw_prompt=MESSAGES, uid="a-random-uuid")
    for sample_id in (0, 1):
        asyncio.run(loop.run({"temperature": 1.0}, session_id=sample_id, **sample))
    assert [s["seed"] for s in sent] == [sample_seed(42, 3, 7, s, MESSAGES) for s in (0, 1)]
    assert all(s["temperature"] == 1.0 for s in sent)


def test_agent_loop_refuses_a_sample_without_its_place(monkeypatch):
    loop, _ = seeded_loop(monkeypatch)
    with pytest.raises(ValueError, match=r"\['session_id'\].*use_v1"):
        asyncio.run(loop.run({}, global_steps=1, index=0, raw_prompt=MESSAGES))


def buffer(mode: str = "sync") -> OrderedReplayBuffer:
    return OrderedReplayBuffer(mode, trainer_config={}, max_off_policy_threshold=None,
                               max_off_policy_strategy="drop", sampler_kwargs={})  # fmt: skip


def test_replay_batch_in_dataloader_order_whatever_the_finish_order(monkeypatch):
    monkeypatch.setattr(replay_mod.tq, "kv_clear", lambda **kw: None)
    rb = buffer()
    dataloader = ["uid-c", "uid-a", "uid-b"]  # the dataloader's order (the uids themselves are random uuids)
    for uid in dataloader:
        rb.prompt_global_steps["train"][uid] = 5
        rb.finished_keys["train"].add(uid)
    want = [f"{uid}_{s}_0" for uid in dataloader for s in range(2)]
    for finish_order in (want[::-1], [want[i] for i in (3, 0, 5, 1, 4, 2)]):
        rb.partitions["train"] = {k: {"status": "success", "seq_len": 10} for k in finish_order}
        uids, snapshot, _ = rb._select_prompt_uids("train", set(dataloader), 3)
        assert uids == dataloader
        assert rb._materialize_batch("train", uids, snapshot).keys == want


def test_replay_refuses_a_partial_batch_and_async_modes():
    rb = buffer()
    rb.prompt_global_steps["train"].update({"uid-a": 1, "uid-b": 1})
    rb.finished_keys["train"].add("uid-a")
    rb.failure_keys["train"].add("uid-b")
    with pytest.raises(RuntimeError, match=r"1 prompt group.*uid-b.*no partial batch"):
        rb._select_prompt_uids("train", {"uid-a", "uid-b"}, 2)
    with pytest.raises(ValueError, match="trainer_mode=sync, got 'fully_async'"):
        buffer("fully_async")
    for mode in ("colocate_async", "separate_async"):  # named, with what to use instead
        with pytest.raises(ValueError, match=rf"got '{mode}'.*use verl's own ReplayBuffer"):
            buffer(mode)
