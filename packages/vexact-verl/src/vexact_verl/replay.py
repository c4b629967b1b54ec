"""A training batch in dataloader order, not in the order rollouts finish: verl's sync replay buffer, ordered.

verl 0.9.1's V1 trainer reads each step's batch from its ``ReplayBuffer`` (``verl/trainer/ppo/v1/replay_buffer.py``),
whose ``_materialize_batch`` lists the trajectories in the order the TransferQueue received them, i.e. the order in
which the agent loops finished. That order changes from run to run (Ray and asyncio scheduling, reward workers), and
every sum over the batch follows it: GRPO's group means and standard deviations, the loss, the weight gradients'
reduction over tokens, the logged means. Bitwise-equal rollouts then still give last-bit different updates.

:class:`OrderedReplayBuffer` lists them by (the prompt's place in the dataloader's batch, ``session_id``, output
index), a function of the data alone, and picks prompts by (trainer step, dataloader place) rather than from a set's
iteration order. It also refuses a batch with a failed group (an agent loop raised: a dead rollout replica, a bad
request): verl's default pads the missing trajectories and trains on the rest. Select it with
``trainer.v1.sampler.custom_sampler.path=pkg://vexact_verl.replay`` and
``trainer.v1.sampler.custom_sampler.name=OrderedReplayBuffer``. verl's synchronous trainer only
(``trainer.v1.trainer_mode=sync``), without DAPO group filtering (verl hands a custom sampler no filter settings).

The asynchronous modes (``colocate_async``, ``separate_async``) are refused, naming the mode: there a step trains on
whichever groups finished first, possibly cut by a weight sync and resumed under newer weights, so the batch's
content, not only its order, follows timing. What stays exact there is each token: its logprob is the trainer's at
the policy version that produced it (:mod:`vexact_verl.versions`). Use verl's own ``ReplayBuffer`` in those modes.
"""

from __future__ import annotations

import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer


class OrderedReplayBuffer(ReplayBuffer):
    """verl's sync ``ReplayBuffer`` with a batch order fixed by the data, and no partial batch (module docstring)."""

    def __init__(self, trainer_mode: str, *args, **kwargs):
        if trainer_mode != "sync":
            raise ValueError(
                f"OrderedReplayBuffer serves trainer.v1.trainer_mode=sync, got {trainer_mode!r}: in an asynchronous "
                "mode which responses a step trains on, and where a weight sync cut them, depend on rollout timing, "
                "so no order of them is reproducible. For colocate_async or separate_async use verl's own "
                "ReplayBuffer (drop trainer.v1.sampler.custom_sampler.path and .name); every response's logprobs "
                "still equal the trainer's at the policy version that produced them (vexact_verl.versions)"
            )
        super().__init__(trainer_mode, *args, **kwargs)

    def _select_prompt_uids(self, partition_id: str, sampleable_keys: set[str], batch_size: int):
        failed = sorted(sampleable_keys & self.failure_keys[partition_id])
        if failed:
            raise RuntimeError(
                f"{len(failed)} prompt group(s) of the {partition_id!r} batch failed in the rollout (uids "
                f"{failed[:4]}{' ...' if len(failed) > 4 else ''}); the agent loop worker's log has the error (a "
                "dead rollout replica names itself there). OrderedReplayBuffer trains on no partial batch"
            )
        steps = dict(self.prompt_global_steps[partition_id])
        place = {uid: i for i, uid in enumerate(steps)}  # the TransferQueue lists prompts as the dataloader gave them
        ordered = sorted(sampleable_keys, key=lambda uid: (steps.get(uid, 0), place.get(uid, len(place))))
        return ordered[:batch_size], dict(self.partitions[partition_id]), steps

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict):
        tq.kv_clear(partition_id=partition_id, keys=selected_prompt_uids)
        rank = {uid: i for i, uid in enumerate(selected_prompt_uids)}
        rows = []
        for key, tag in partition_snapshot.items():
            uid, sample, index = key.rsplit("_", 2)  # {uid}_{session_id}_{index}; uid is a uuid4 (no "_")
            if uid in rank:
                rows.append(((rank[uid], int(sample), int(index)), key, tag))
        rows.sort(key=lambda row: row[0])
        return KVBatchMeta(partition_id=partition_id, keys=[r[1] for r in rows], tags=[r[2] for r in rows])
