"""Compare the SASS of every Triton kernel between a git revision and the working tree, compiled for a GPU on a
machine without one.

    python scripts/tuning/sass_diff.py [--base main] [--arch 90] [--only attention,...] [--match 'packed'] \
        [--keep DIR] [--runs N]

A refactor of a kernel (a ``@triton.jit`` helper called from two places, a reordered expression) may or may not
change what ptxas emits; the golden fixtures recorded on GPUs hold only if it does not. This script answers that
without a GPU: it exports ``packages/vexact-kernels/src`` at ``--base`` (``git archive``), then, once for that copy
and once for the working tree, compiles every kernel launch of :mod:`kernel_regs`'s scenarios (the Qwen3-1.7B shapes
of the engine's and the trainer's paths, through its stand-in driver: nothing runs; the split launches twice, with
their combine in a kernel of its own and fused in the launch) and writes, per compiled kernel, ``cuobjdump -sass`` of
its cubin, headed by its launch metadata (warps, stages, shared memory). Both sides use this checkout's scenarios, so
a host function's signature must be the same at both. The two dumps are then compared byte for byte, file by file.

Nothing is stripped from the SASS listing: for a cubin, cuobjdump prints the target, the function name, its header
flags and each instruction with its offset and its 128-bit encoding (opcode, operands and the scheduling control
bits), and nothing that depends on file paths or source lines (Triton's line info lives in the cubin's debug
sections, which ``-sass`` does not print; the cubins' bytes therefore differ when only lines move, the SASS does not).

Prints one line per kernel that differs or is missing on one side, then ``N kernels compared, M identical``; exits 1
unless every kernel's SASS is identical. ``--keep DIR`` keeps the dumps (``DIR/base.0``, ``DIR/head.0``, ...) for a
``diff -r``. At sm_90 two compiles of one source give the same SASS; at sm_100 (Triton 3.6's ptxas-blackwell) some
kernels' register numbering changes from one compile to the next. ``--runs N`` compiles each side N times and takes a
kernel as identical when one of the base's compiles and one of the working tree's are the same bytes (a kernel whose
compiles differ is marked unstable where it differs).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNELS_SRC = "packages/vexact-kernels/src"


def dump(src: str, out: str, arch: int, only: str, match: str) -> int:
    """Compile every scenario's kernels with ``vexact_kernels`` from ``src`` and write their SASS under ``out``."""
    sys.path.insert(0, src)
    sys.path.insert(0, HERE)
    import kernel_regs as kr

    import vexact_kernels

    assert os.path.realpath(vexact_kernels.__file__).startswith(os.path.realpath(src)), vexact_kernels.__file__
    groups = {g for g in only.split(",") if g}
    os.makedirs(out, exist_ok=True)
    for fused, group, name, call in _calls(kr, arch):
        if (groups and group not in groups) or match not in name:
            continue
        kr.install_stand_in(arch, fused_combine=fused)
        scenario = f"{group}: {name}" + (", fused combine" if fused else "")
        kr._scenario[0] = scenario
        try:
            call()
        except Exception as e:  # recorded, so that a side that cannot compile a scenario shows as a difference
            with open(os.path.join(out, f"{_slug(scenario)}.error"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            continue
        kernels = [(k, c) for s, k, c in kr.COMPILED if s == scenario]
        for i, (kname, kernel) in enumerate(kernels):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.run(
                    [f"{kr.BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True
                ).stdout
            meta = kernel.metadata
            head = f"# {scenario} | {kname} | warps {meta.num_warps} stages {meta.num_stages} shared {meta.shared}\n"
            with open(os.path.join(out, f"{_slug(scenario)}.{i}.{kname}.sass"), "w") as f:
                f.write(head + sass)
    return 0


def _calls(kr, arch: int):
    """(fused combine, group, name, call): every scenario with the two-launch combine, then those with a split
    launch (matmul, attention, the logprobs backward's matmuls) again with the combine fused in the launch."""
    for group, name, call in kr.scenarios(arch):
        yield False, group, name, call
    for group, name, call in kr.scenarios(arch):
        if group in ("linear", "attention", "logprobs"):
            yield True, group, name, call


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9=]+", "_", s).strip("_")


def _read(folder: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def compare(base: list[str], head: list[str]) -> tuple[int, int, list[str]]:
    """(kernels compared, identical, a line per difference) of the dumps of the two sides (one or more compiles each).
    A kernel is identical when a compile of the base and one of the head give the same bytes."""
    a, b = [_read(d) for d in base], [_read(d) for d in head]
    names = sorted(set().union(*a, *b))
    same, lines = 0, []
    for name in names:
        va, vb = {d[name] for d in a if name in d}, {d[name] for d in b if name in d}
        unstable = " (unstable: its compiles differ)" if max(len(va), len(vb)) > 1 else ""
        if not (va and vb):
            lines.append(f"only in {'base' if va else 'head'}: {name}")
        elif name.endswith(".error"):
            lines.append(f"not compiled on either side: {name}: {next(iter(va)).decode().strip()}")
        elif va & vb:
            same += 1
        else:
            la, lb = next(iter(va)).decode().splitlines(), next(iter(vb)).decode().splitlines()
            first = next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), min(len(la), len(lb)))
            lines.append(f"differs: {name} ({len(la)} vs {len(lb)} lines, first at line {first + 1}){unstable}")
    return sum(not n.endswith(".error") for n in names), same, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare the working tree against")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10: 80 (A100), 90 (H100/H200), 100")
    ap.add_argument("--only", default="", help="comma-separated groups: logprobs, linear, attention, norm, other")
    ap.add_argument("--match", default="", help="only the calls whose name contains this")
    ap.add_argument("--keep", default="", help="a folder to keep the dumps in (base.0/, head.0/, ...)")
    ap.add_argument("--runs", type=int, default=1, help="compiles of each side (sm_100: 3 or more)")
    ap.add_argument("--dump", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)  # one side, in a subprocess
    args = ap.parse_args()
    if args.dump:
        return dump(args.dump[0], args.dump[1], args.arch, args.only, args.match)

    work = args.keep or tempfile.mkdtemp(prefix="sass_diff_")
    base_tree = os.path.join(work, "base_tree")
    os.makedirs(base_tree, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, KERNELS_SRC], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", base_tree], input=archive.stdout, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    flags = ["--arch", str(args.arch), "--only", args.only, "--match", args.match]
    dumps: dict[str, list[str]] = {"base": [], "head": []}
    for run in range(max(1, args.runs)):
        for side, src in (("base", os.path.join(base_tree, KERNELS_SRC)), ("head", os.path.join(ROOT, KERNELS_SRC))):
            out = os.path.join(work, f"{side}.{run}")
            if os.path.isdir(out):
                for name in os.listdir(out):
                    os.remove(os.path.join(out, name))
            cmd = [sys.executable, os.path.abspath(__file__), "--dump", src, out, *flags]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            dumps[side].append(out)
    total, same, lines = compare(dumps["base"], dumps["head"])
    print("\n".join(lines))
    print(f"{total} kernels compared ({args.base} vs working tree, sm_{args.arch}), {same} identical")
    if args.keep:
        print(f"dumps: {work}/base.*, {work}/head.*")
    return 0 if lines == [] and total > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
