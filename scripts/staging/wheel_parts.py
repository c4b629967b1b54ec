"""Wheels cut into parts of a bounded size, so that an air-gapped GPU machine can receive them one part at a time
over a copy channel that limits the size of each copy, and joined back there. Shared by the stagers in
scripts/staging/ (verl, vLLM, FA4, rl_stack_wheels.sh).

    python3 scripts/staging/wheel_parts.py pack DIR MIB PREFIX [--order G1,G2,...]
        DIR/all/* -> DIR/<PREFIX>1, DIR/<PREFIX>2, ... : a file over MIB is cut into NAME.part-00, -01, ...; the
        parts are filled greedily, biggest first, to at most MIB each; every part gets MANIFEST (the sha256 of
        every whole file). DIR/all is removed. --order: files named GROUP__* are packed group by group in that
        order (a group's parts before the next group's; unlisted groups last), so the first groups are whole,
        and can be installed, before the later ones arrive.
    python3 scripts/staging/wheel_parts.py join DIR [--group G]...
        DIR holds the files of the parts copied so far (one part after another): joins every NAME.part-* back
        into NAME and checks MANIFEST. Exit 0 when every file is whole and matches, 3 when files are still missing
        (copy the next part), 1 on a mismatch. --group: only the files named G__* count.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

PIECE = ".part-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _group(name: str) -> str:
    return name.split("__", 1)[0] if "__" in name else ""


def pack(root: Path, mib: int, prefix: str, order: list[str] | None = None) -> None:
    alldir = root / "all"
    files = sorted(alldir.iterdir())
    manifest = "".join(f"{_sha256(f)}  {f.name}\n" for f in files)
    rank = {g: i for i, g in enumerate(order or [])}
    batches: dict[int, list[Path]] = {}
    for f in files:
        batches.setdefault(rank.get(_group(f.name), len(rank)), []).append(f)
    parts: list[list] = []  # [size, [paths]]
    for key in sorted(batches):
        parts += _fill(batches[key], mib << 20)
    for i, (size, paths) in enumerate(parts, 1):
        d = root / f"{prefix}{i}"
        d.mkdir()
        for path in paths:
            shutil.move(path, d)
        (d / "MANIFEST").write_text(manifest)
        groups = sorted({_group(p.name) for p in paths})
        print(f"{d}: {len(paths)} files, {size / 2**20:.1f} MiB ({', '.join(groups)})")
    alldir.rmdir()
    print(f"total {sum(s for s, _ in parts) / 2**20:.1f} MiB in {len(parts)} parts, {len(files)} files")


def _fill(files: list[Path], cap: int) -> list[list]:
    """``files`` (a file over ``cap`` cut into pieces) in parts of at most ``cap`` bytes, biggest first."""
    pieces: list[tuple[int, Path]] = []
    for f in files:
        size = f.stat().st_size
        if size <= cap:
            pieces.append((size, f))
            continue
        with f.open("rb") as src:
            for i, chunk in enumerate(iter(lambda: src.read(cap), b"")):
                piece = f.with_name(f"{f.name}{PIECE}{i:02d}")
                piece.write_bytes(chunk)
                pieces.append((len(chunk), piece))
        f.unlink()
    parts: list[list] = []  # [size, [paths]]
    for size, path in sorted(pieces, key=lambda p: (-p[0], p[1].name)):
        for part in parts:
            if part[0] + size <= cap:
                part[0] += size
                part[1].append(path)
                break
        else:
            parts.append([size, [path]])
    return parts


def join(root: Path, groups: list[str] | None = None) -> int:
    lines = [line.split(maxsplit=1) for line in (root / "MANIFEST").read_text().splitlines()]
    if groups:
        lines = [(digest, name) for digest, name in lines if _group(name) in groups]
        if not lines:
            print(f"MANIFEST names no file of group(s) {groups}", file=sys.stderr)
            return 1
    missing = []
    for digest, name in lines:
        whole = root / name
        pieces = sorted(root.glob(f"{name}{PIECE}*"))
        if not whole.exists() and not pieces:
            missing.append(name)
        elif pieces:
            with whole.open("wb") as out:
                for piece in pieces:
                    out.write(piece.read_bytes())
            if _sha256(whole) != digest:  # a piece is still to come (or damaged): keep the pieces, drop the join
                whole.unlink()
                missing.append(name)
                continue
            for piece in pieces:
                piece.unlink()
    if missing:
        print(f"waiting for more parts: {len(missing)} file(s) not whole yet, e.g. {missing[0]}")
        return 3
    bad = [name for digest, name in lines if _sha256(root / name) != digest]
    if bad:
        print(f"sha256 mismatch: {bad}", file=sys.stderr)
        return 1
    print(f"all {len(lines)} files{' of ' + ','.join(groups) if groups else ''} whole, sha256 checked")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("dir", type=Path)
    p.add_argument("mib", type=int)
    p.add_argument("prefix")
    p.add_argument("--order", default="", help="comma-separated groups, packed in this order")
    j = sub.add_parser("join")
    j.add_argument("dir", type=Path)
    j.add_argument("--group", action="append", help="only this group's files (GROUP__NAME); repeatable")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.dir, args.mib, args.prefix, [g for g in args.order.split(",") if g])
        return 0
    return join(args.dir, args.group)


if __name__ == "__main__":
    sys.exit(main())
