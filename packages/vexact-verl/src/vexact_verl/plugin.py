"""verl's plugin hook: importing this module registers the ``vexact`` rollout (see :mod:`vexact_verl.registration`).

Named by this package's ``verl.plugins`` entry point, so ``import verl`` loads it in every process.
"""

from .registration import register

register()
