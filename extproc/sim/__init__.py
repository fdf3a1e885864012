"""Stand-ins for model servers (there are no GPUs here): the demo, tests and benchmarks
route to these."""

# The response header every stand-in sets to its own name: how tests and benchmarks see which
# server a request really reached (the picker's choice is only what it asked Envoy for).
SERVED_BY_HEADER = "x-served-by"
# Request header: "1" adds an SSE comment before the first token with its KV wait, prefill
# lane wait and prefill time (`: timing kv_wait_s=... lane_wait_s=... prefill_s=...
# recv_at=...`, the last the wall-clock time the request reached the server).
TIMING_HEADER = "x-sim-timing"
