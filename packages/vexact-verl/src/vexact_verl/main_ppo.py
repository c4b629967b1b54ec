"""``python -m vexact_verl.main_ppo <hydra overrides>``: verl's own ``verl.trainer.main_ppo``, with ``vexact`` known.

A thin wrapper, no copy of verl code: it registers the backend in this process and exports
``VERL_USE_EXTERNAL_MODULES=vexact_verl.plugin`` before verl starts Ray, so that every Ray worker (which inherits the
driver's environment on a local cluster) registers it too, also where this package is on ``PYTHONPATH`` rather than
installed (an installed package does the same through its ``verl.plugins`` entry point). Then it calls verl's
``main()``: all of verl's Hydra config and overrides apply unchanged, e.g.
``actor_rollout_ref.rollout.name=vexact +actor_rollout_ref.rollout.engine_kwargs.vexact.backend=invariant``, and
``actor_rollout_ref.actor.strategy=vexact`` for the invariant actor (the ref follows; see
:mod:`vexact_verl.actor_engine`).
"""

from __future__ import annotations

import os


def main() -> None:
    modules = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if "vexact_verl.plugin" not in modules:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([*modules, "vexact_verl.plugin"])
    from .registration import register

    register()
    from verl.trainer.main_ppo import main as verl_main

    verl_main()


if __name__ == "__main__":
    main()
