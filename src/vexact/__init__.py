"""VeXact: the monorepo's meta-package and CLI (``vexact demo``)."""

__version__ = "0.3.0"
