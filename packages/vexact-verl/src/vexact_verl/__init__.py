"""vexact-verl: verl integration for VeXact.

``import vexact_verl`` registers the ``vexact`` rollout backend with verl (when verl is installed), so a verl run
switches to it with ``actor_rollout_ref.rollout.name=vexact``. The package's ``verl.plugins`` entry point does the
same inside verl's Ray workers. The server and adapter classes are importable for tests and custom launchers.
"""

from __future__ import annotations

import importlib.util

from .actor import packed_log_probs
from .registration import ROLLOUT_NAME, is_registered, register
from .server import ServerSettings, VexactServer
from .tim import tim_step_metrics

__version__ = "0.3.1"

__all__ = [
    "ROLLOUT_NAME",
    "ServerSettings",
    "VexactServer",
    "__version__",
    "is_registered",
    "packed_log_probs",
    "register",
    "tim_step_metrics",
]

if importlib.util.find_spec("verl") is not None:
    register()
