"""vexact-verl: verl integration for VeXact.

Nothing is implemented in this release: the package exists so the monorepo layout and versioning are in place.
The rollout backend (``rollout.name=vexact``), weight sync and invariant actor come with the verl integration.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
