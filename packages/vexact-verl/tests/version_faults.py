"""Faults for ``test_verl_async_trainer_cpu.py``: the version the vexact rollout server is told on verl's
checkpoint-engine path, made wrong, so that the test sees the actor's per-version check fail. Imported in every
process of a verl run through ``VERL_USE_EXTERNAL_MODULES`` (the test puts this folder on ``PYTHONPATH``);
``$VEXACT_VERSION_FAULT`` picks the fault:

- ``untold``: the server is told the initial version (``global_steps=0``) and no later one, as if the version did not
  travel with the checkpoint engine's weights: every token is labelled 0 whichever weights produced it.
- ``ahead``: from the first retrained weights on, the server is told one version more than the weights it receives:
  every later token is labelled one version newer than the weights that produced it.

Nothing outside the tests imports it.
"""

from __future__ import annotations

import os

from vexact_verl.rollout import ServerAdapter

FAULTS = {
    "untold": lambda v: None if v else v,  # None: the adapter leaves the server's version as it was
    "ahead": lambda v: v + 1 if v else v,
}
FAULT = os.environ.get("VEXACT_VERSION_FAULT", "")
if FAULT not in FAULTS:
    raise ValueError(f"VEXACT_VERSION_FAULT={FAULT!r}: use one of {sorted(FAULTS)}")

_update_weights = ServerAdapter.update_weights


async def update_weights(self, weights, global_steps=None, **kwargs):
    told = FAULTS[FAULT](global_steps)
    return await _update_weights(self, weights, global_steps=told, **kwargs)


if not getattr(ServerAdapter.update_weights, "_fault", False):
    update_weights._fault = True
    ServerAdapter.update_weights = update_weights
