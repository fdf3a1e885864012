"""The hostile-input properties of tests/hostile and tests/requests, run with a large budget:
request parsers (chat, completions, Anthropic Messages, Responses; plus precise keys), media
sniffers, the KV-event decoder, and random ext_proc message sequences through a real gRPC
picker (in-flight counters checked after every sequence).

    uv run python bench/fuzz.py                     # 5000 examples per property
    uv run python bench/fuzz.py --examples 50000 --only stream,anthropic

Same strategies and checks as the CI tests (imported from them), a larger `max_examples`
and no example database, so every run explores afresh. Exit status 1 on the first failing
property (hypothesis prints the shrunk input).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.*

from extproc.testing import ThreadedPicker, picker_in_thread
from tests.hostile import test_fuzz_bodies as bodies
from tests.hostile import test_fuzz_decoders as decoders
from tests.hostile import test_fuzz_stream as stream
from tests.hostile.conftest import hostile_settings
from tests.requests import test_properties as props


def threaded_picker() -> contextlib.AbstractContextManager[ThreadedPicker]:
    """The hostile tests' picker, outside pytest."""
    return picker_in_thread(hostile_settings())


def properties(picker: ThreadedPicker) -> dict[str, tuple[Callable, tuple]]:
    """name -> (check, strategies): the CI tests' inner functions and their strategies."""

    def inner(test):
        return test.hypothesis.inner_test

    return {
        "bytes": (inner(props.test_any_bytes_give_a_request_or_a_400), (
            props.PATHS, st.binary(max_size=2000))),
        "json": (inner(props.test_any_json_shaped_body_gives_a_request_or_a_400), (
            props.PATHS, props.headers, props.bodies)),
        "corrupted": (inner(props.test_truncated_or_corrupted_bodies_give_a_request_or_a_400), (
            props.PATHS, props.bodies, st.data())),
        "anthropic": (bodies.answer, (st.just("/v1/messages"), bodies.anthropic_bodies)),
        "responses": (bodies.answer, (st.just("/v1/responses"), bodies.responses_bodies)),
        "kv-bytes": (inner(decoders.test_any_bytes_decode_to_events_or_a_decode_error), (
            st.binary(max_size=2000),)),
        "kv-batch": (inner(decoders.test_any_msgpack_batch_decodes_to_events_or_a_decode_error), (
            st.floats(allow_nan=True), st.lists(decoders.events, max_size=8),
            st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)))),
        "image": (inner(decoders.test_any_image_header_gives_a_size_none_or_invalid_media), (
            decoders.headers, st.binary(max_size=400))),
        "wav": (inner(decoders.test_any_bytes_give_a_wav_duration_none_or_invalid_media), (
            st.binary(max_size=400),)),
        "stream": (
            lambda msgs: inner(stream.test_any_message_sequence_gets_answers_and_leaks_nothing)(
                picker, msgs
            ),
            (st.lists(stream.messages, max_size=10),),
        ),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--examples", type=int, default=5000, help="per property (default 5000)")
    ap.add_argument("--only", default="", help="comma list of property names")
    args = ap.parse_args()
    budget = settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    with threaded_picker() as picker:
        chosen = properties(picker)
        if args.only:
            chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
        total_t = time.perf_counter()
        for name, (check, strategies) in chosen.items():
            t = time.perf_counter()
            budget(given(*strategies)(check))()
            print(f"{name:10s} {args.examples} examples  ok  {time.perf_counter() - t:6.1f} s")
        inflight = picker.call(lambda: picker.app.router.inflight.total())
        print(
            f"all ok in {time.perf_counter() - total_t:.0f} s; picker in-flight at end: {inflight}"
        )
        return 0 if inflight == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
