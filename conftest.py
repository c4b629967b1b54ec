"""Repo-wide pytest options: ``--target`` selects which contract target (cpu, h100, h200, b200) runs."""

import os

import pytest

TARGETS = ("cpu", "h100", "h200", "b200")

# Without a GPU, the Triton kernels are exercised on CPU tensors through Triton's interpreter. The variable must be
# set before triton is imported; tests of Triton kernels on CPU tensors skip themselves when it is not set.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        default=os.environ.get("VEXACT_TARGET", "cpu"),
        choices=TARGETS,
        help="contract target (default: $VEXACT_TARGET or cpu)",
    )


def pytest_report_header(config):
    """Which attention implementation CUDA tests run (``$VEXACT_ATTENTION``): their bits and fixtures depend on it."""
    try:
        import vexact_kernels

        return f"vexact attention implementation on CUDA: {vexact_kernels.get_attention_impl()}"
    except (ImportError, ValueError) as e:
        return f"vexact attention implementation on CUDA: {e}"


def pytest_configure(config):
    # One intra-op thread per test process: the CPU suite's tensors are small, and with xdist workers (or anything
    # else) sharing the two CI cores, torch's threads otherwise wait on each other (seen: 2.5 s -> 51 s). Results do
    # not depend on the thread count (the golden fixture was recorded with the default count).
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` run first, in their collected order: under xdist a long test that starts near the end
    keeps one worker busy while the others have nothing left (longest first is how a set of jobs ends soonest on a
    few workers). A test marked ``gpu`` needs CUDA: where there is none it is skipped, visibly, with that reason (one
    rule for every package, instead of a ``skipif`` beside each ``gpu`` mark)."""
    import torch

    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slow") is None)  # stable: False (slow) first
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
