"""Reproducer for the pyvoy defect that blocks the picker on pyvoy (bench/RESULTS.md, issue 17,
seventh session): bidi gRPC streams that the client ends with RST_STREAM (as Envoy's ext_proc
client ends its streams) make pyvoy 1.3.0 drop the HTTP/2 connection with GOAWAY
INTERNAL_ERROR after about 1,050 of them; streams in flight on it fail. Streams the client
half-closes do not (the same count of them passes). No Envoy in front: a grpcio client against
the floor on pyvoy.

    uv pip install --target DIR pyvoy==1.3.0
    PYTHONPATH=DIR uv run python bench/pyvoy_resets.py [--streams 3000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import os
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from extproc import protocol
from extproc.server import wire
from extproc.stack import free_port
from extproc.testing import post, request_body, request_headers, response_headers

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    port = free_port()
    floor = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("floor_processor.py")), str(port),
         "127.0.0.1:9", "--transport=pyvoy", "--envoy-concurrency=1"],
        env=os.environ.copy(),
    )  # fmt: skip
    try:
        for _ in range(60):  # pyvoy starts its Envoy and the interpreter: seconds
            try:
                cert = ssl.get_server_certificate(("127.0.0.1", port)).encode()
                break
            except OSError:
                time.sleep(1)
        channel = grpc.secure_channel(
            f"127.0.0.1:{port}",
            grpc.ssl_channel_credentials(cert),
            options=[("grpc.ssl_target_name_override", "localhost")],
        )
        call = channel.stream_stream(
            protocol.EXT_PROC_METHOD,
            request_serializer=wire.ProcessingRequest.SerializeToString,
            response_deserializer=wire.ProcessingResponse.FromString,
        )
        msgs = [
            request_headers(post("/v1/chat/completions", {})),
            request_body(BODY, end_of_stream=True),
            response_headers(200, served="127.0.0.1:9"),
        ]
        for m in msgs:
            m.protocol_config.request_body_mode = wire.BodySendMode.FULL_DUPLEX_STREAMED

        def one(reset: bool) -> bool:
            done = threading.Event()

            def requests():
                yield from msgs
                if reset:
                    done.wait(10)  # never half-close: the call is cancelled instead

            it = call(requests(), timeout=10)
            try:
                for n, _ in enumerate(it, 1):
                    if n == 3:  # decision, body, response-header reply
                        break
                if reset:
                    it.cancel()  # RST_STREAM(CANCEL), as Envoy ends an ext_proc stream
                else:
                    list(it)
                return True
            except grpc.RpcError:
                return False
            finally:
                done.set()

        with ThreadPoolExecutor(args.concurrency) as pool:
            for reset in (False, True):
                ok = sum(pool.map(lambda _: one(reset), range(args.streams)))  # noqa: B023
                how = "reset by the client" if reset else "half-closed by the client"
                print(f"{args.streams} streams {how}, {args.concurrency} at a time: "
                      f"{args.streams - ok} failed", flush=True)  # fmt: skip
    finally:
        floor.terminate()
        floor.wait()


if __name__ == "__main__":
    main()
