"""scripts/staging/wheel_parts.py: parts packed group by group, and a group joined before the later ones arrive."""

import shutil
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "scripts/staging/wheel_parts.py"
MIB = 1 << 20


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def test_groups_pack_in_order_and_join_one_at_a_time(tmp_path):
    stage = tmp_path / "stage"
    (stage / "all").mkdir(parents=True)
    sizes = {"b__big.whl": 2 * MIB + 7, "b__small.whl": 300, "a__one.whl": MIB + 5, "a__two.whl": 900, "c__x.whl": 10}
    whole = {}
    for i, (name, size) in enumerate(sizes.items()):
        whole[name] = bytes([i + 1]) * size
        (stage / "all" / name).write_bytes(whole[name])
    r = run("pack", stage, 1, "p", "--order", "a,b")
    assert r.returncode == 0, r.stderr
    parts = sorted((p for p in stage.iterdir() if p.name.startswith("p")), key=lambda p: int(p.name[1:]))
    groups = [{f.name.split("__")[0] for f in p.iterdir() if f.name != "MANIFEST"} for p in parts]
    assert all(len(g) == 1 for g in groups), groups  # no part mixes two groups
    order = [g.pop() for g in groups]
    assert order == sorted(order) and order[0] == "a" and order[-1] == "c", order  # listed order, unlisted last

    dest = tmp_path / "dest"
    dest.mkdir()
    seen = []
    for part in parts:  # one part a step, as over a channel that carries one part at a time
        for f in part.iterdir():
            shutil.copy(f, dest / f.name)
        seen.append(part.name)
        done = {g: run("join", dest, "--group", g).returncode for g in "abc"}
        last = {o: max(i for i, g in enumerate(order) if g == o) for o in set(order)}
        for g in "abc":  # a group is whole exactly once its own last part has arrived
            assert done[g] == (0 if len(seen) > last[g] else 3), (seen, g, done)
    assert run("join", dest).returncode == 0
    for name, data in whole.items():
        assert (dest / name).read_bytes() == data
    r = run("join", dest, "--group", "nope")
    assert r.returncode == 1 and "nope" in r.stderr


def test_join_reports_a_damaged_file(tmp_path):
    stage = tmp_path / "stage"
    (stage / "all").mkdir(parents=True)
    (stage / "all" / "a__one.whl").write_bytes(b"x" * 100)
    assert run("pack", stage, 1, "p").returncode == 0
    (stage / "p1" / "a__one.whl").write_bytes(b"y" * 100)
    r = run("join", stage / "p1")
    assert r.returncode == 1 and "a__one.whl" in r.stderr
