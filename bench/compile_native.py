"""Compile the per-request modules in place (experiment only: the package ships pure Python).

The sixth session's go/no-go on taking the per-request path out of the interpreter
(bench/RESULTS.md, issue 17): this builds the modules a 1 KB request runs through as C
extensions next to their sources, where the editable install then imports them instead of
the `.py` files (`extproc serve`, the tests, `bench/profile_instructions.py` and
`bench/bench_proxy.py`'s picker all pick them up); `--clean` removes them again. Nothing else
does: leftover `.so` files silently change what runs, so clean after measuring.

    uv pip install cython==3.3.1          # not a project dependency; `uv sync` removes it
    uv run python bench/compile_native.py --tool cython   # or mypyc (ships with mypy)
    uv run python bench/compile_native.py --clean

Cython compiles all of `CYTHON` unchanged (annotations not used as C types, so the semantics
stay Python's). mypyc compiles only `MYPYC`; the rest fail for the reasons in `MYPYC_NO`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _paths(text: str) -> list[str]:
    return text.split()


MYPYC = _paths(
    "extproc/requests/sniff.py extproc/requests/media.py extproc/hashing/prefix.py "
    "extproc/index/memory.py extproc/index/prefix.py extproc/index/capacity.py "
    "extproc/scheduling/timing.py extproc/router.py extproc/calibration.py "
    "extproc/server/wire.py extproc/server/llmd_metrics.py extproc/server/limits.py "
    "extproc/server/metric_stores.py extproc/server/access_log.py extproc/server/guard.py "
    "extproc/endpoints/inflight.py extproc/endpoints/state.py extproc/endpoints/prefill_speed.py "
    # The session record bounded-sessions-filter (default profile) reads and writes for every
    # request, split out of sessions.py after this list was made; mypyc compiles them unchanged
    # and tests/scheduling's session tests pass against the build (twenty-sixth session).
    "extproc/scheduling/plugins/session_chains.py extproc/scheduling/plugins/session_growth.py "
    "extproc/scheduling/plugins/session_fates.py extproc/scheduling/plugins/session_classes.py"
)

# Modules mypyc cannot compile as they are, and why.
STRUCTS = _paths(
    "extproc/core.py extproc/requests/parse.py extproc/requests/openai.py "
    "extproc/requests/anthropic.py extproc/requests/settings.py "
    "extproc/hashing/estimate.py extproc/endpoints/request_end.py "
    "extproc/scheduling/handlers.py extproc/scheduling/plugins/pickers.py "
    "extproc/scheduling/plugins/prefix.py extproc/scheduling/plugins/scorers.py "
    "extproc/scheduling/plugins/sessions.py extproc/scheduling/plugins/ttft.py"
)
MYPYC_NO = {
    # A msgspec.Struct subclass becomes a class built by `type(name, bases, ns)`: the class
    # keywords (frozen=True, tag=..., rename=...) are dropped and the annotations replaced by
    # type objects, so decoding breaks ("Expected `type`, got `bool`"). Plugins: their Params.
    "defines msgspec Structs": STRUCTS,
    "@runtime_checkable Protocols": ["extproc/scheduling/framework.py"],
    # grpc.aio's stream handler is an async generator (also: `x in (A, *B)` hit an internal
    # mypyc error, fixed by `x != A and x not in B`).
    "async generators unimplemented": ["extproc/server/stream.py"],
}

CYTHON = sorted({*MYPYC, *(m for ms in MYPYC_NO.values() for m in ms)})


def clean() -> int:
    gone = [*(ROOT / "extproc").rglob("*.so"), *ROOT.glob("*__mypyc*.so")]
    for p in gone:
        p.unlink()
    shutil.rmtree(ROOT / "build" / "native", ignore_errors=True)
    return len(gone)


def build(tool: str) -> None:
    from setuptools import setup

    if tool == "cython":
        from Cython.Build import cythonize
        from setuptools import Extension

        exts = [Extension(m[:-3].replace("/", "."), [m]) for m in CYTHON]
        ext_modules = cythonize(
            exts, build_dir="build/native", quiet=True,
            compiler_directives={"language_level": 3, "annotation_typing": False},
        )  # fmt: skip
    else:
        from mypyc.build import mypycify

        ext_modules = mypycify(MYPYC, opt_level="3", target_dir="build/native")
    setup(
        name="extproc-native-experiment", packages=[], py_modules=[], ext_modules=ext_modules,
        script_args=["build_ext", "--inplace", "--build-temp", "build/native/tmp"],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", choices=("cython", "mypyc"))
    ap.add_argument("--clean", action="store_true")
    args = ap.parse_args()
    if args.clean:
        print(f"removed {clean()} compiled modules")
        return
    if not args.tool:
        ap.error("--tool or --clean")
    if clean():
        print("removed the previous build's modules", file=sys.stderr)
    os.chdir(ROOT)
    build(args.tool)


if __name__ == "__main__":
    main()
