"""Reads the cProfiles `bench/cprofile_site` wrote for the pickers of one run and says where
their CPU went: by area (the module a function lives in, extproc's by sub-module, the rest by
top-level package) and the functions with the most own time, summed over every profile given.

    .venv/bin/python bench/profile_read.py /tmp/prof/one/*.prof :: /tmp/prof/three/*.prof

Profiles separated by `::` are read as groups side by side (e.g. one replica's against three
replicas'), each summed; seconds are the profiler's (inflated by its own cost alike).
"""

from __future__ import annotations

import argparse
import pstats
from collections import Counter
from pathlib import Path


def _area(filename: str) -> str:
    path = filename.replace("\\", "/")
    if "/extproc/" in path and "site-packages" not in path:
        tail = path.rsplit("/extproc/", 1)[1].removesuffix(".py")
        return "extproc." + tail.replace("/", ".")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if path.startswith("~") or path == "":
        return "builtins"
    for lib in ("asyncio", "logging", "json", "re", "concurrent", "selectors", "ssl"):
        if f"/{lib}/" in path or path.endswith(f"/{lib}.py"):
            return lib
    return "stdlib/other"


def _load(paths: list[Path]) -> pstats.Stats:
    stats = pstats.Stats(str(paths[0]))
    for p in paths[1:]:
        stats.add(str(p))
    return stats


def _own_times(stats: pstats.Stats) -> tuple[Counter[str], Counter[str], float]:
    """Own seconds per area and per function; the total."""
    areas: Counter[str] = Counter()
    funcs: Counter[str] = Counter()
    total = 0.0
    for (filename, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        area = _area(filename)
        areas[area] += tottime
        short = filename.rsplit("/", 1)[-1]
        funcs[f"{area}:{name} ({short}:{line})"] += tottime
        total += tottime
    return areas, funcs, total


def _cumulative(stats: pstats.Stats, needles: list[str]) -> dict[str, float]:
    """Cumulative seconds of the functions whose name contains each needle (module:qualname
    is not kept by cProfile: `file:function`)."""
    out: dict[str, float] = {}
    for (filename, _, name), (_, _, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{filename.rsplit('/', 1)[-1]}:{name}"
        for n in needles:
            if n == key:
                out[key] = out.get(key, 0.0) + cumtime
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profiles", nargs="+", help="profiles; '::' separates groups")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--cumulative", nargs="*", default=[
            "shared_inflight.py:run", "shared_inflight.py:_merge", "redis_broadcast.py:_received",
            "redis_broadcast.py:_subscribe_loop", "redis_broadcast.py:_publish_loop",
            "shared_scrapes.py:_apply", "scrape.py:apply", "scrape.py:run",
            "exposition.py:parse_metrics", "router.py:route", "stream.py:Process",
            "redis.py:lookup", "redis.py:record", "shared_calibration.py:_apply",
            "inflight_push.py:_apply",
        ],
        help="file:function names whose cumulative seconds to print",
    )  # fmt: skip
    args = p.parse_args()
    groups: list[list[Path]] = [[]]
    for a in args.profiles:
        if a == "::":
            groups.append([])
        else:
            groups[-1].append(Path(a))
    groups = [g for g in groups if g]
    read = [_own_times(_load(g)) for g in groups]
    cum = [_cumulative(_load(g), args.cumulative) for g in groups]
    names = [f"group {i + 1} ({len(g)})" for i, g in enumerate(groups)]
    print("own seconds per area: " + " | ".join(names))
    print("total: " + " | ".join(f"{t:.2f}" for _, _, t in read))
    all_areas = Counter[str]()
    for areas, _, _ in read:
        all_areas.update(areas)
    for area, _ in all_areas.most_common(args.top):
        print(f"  {area:<44} " + " | ".join(f"{a.get(area, 0.0):7.2f}" for a, _, _ in read))
    print("\nown seconds per function (the largest over the groups):")
    all_funcs = Counter[str]()
    for _, funcs, _ in read:
        for f, t in funcs.items():
            all_funcs[f] = max(all_funcs[f], t)
    for f, _ in all_funcs.most_common(args.top):
        print(f"  {f[:90]:<90} " + " | ".join(f"{fs.get(f, 0.0):6.2f}" for _, fs, _ in read))
    print("\ncumulative seconds:")
    for n in args.cumulative:
        print(f"  {n:<44} " + " | ".join(f"{c.get(n, 0.0):7.2f}" for c in cum))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
