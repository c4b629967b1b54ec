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
    # xdist hands each worker a quarter of its share up front, in collection order (so all the slow tests sorted
    # first would go to one worker), then more as tests finish; two at a time spreads the slow ones over the workers
    if getattr(config.option, "maxschedchunk", "no xdist") is None:
        config.option.maxschedchunk = 2


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first, and a test marked ``gpu`` needs CUDA: where there is none it is skipped,
    visibly, with that reason (one rule for every package, instead of a ``skipif`` beside each ``gpu`` mark).

    Slow first, the longest first (``slow(minutes=N)``: about N minutes on CI's two cores): xdist hands the tests
    out in this order, so the verl end-to-end jobs start at once on both workers instead of whenever their file
    comes up; one of them started last is the suite's tail (seen: the resume test alone on one core for the last 6
    minutes)."""
    import torch

    items.sort(key=_run_order)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _run_order(item) -> tuple[int, float]:
    slow = item.get_closest_marker("slow")
    return (0, -float(slow.kwargs.get("minutes", 0))) if slow is not None else (1, 0.0)
