"""The endpoint-picker contract with the proxy, in one place: header names, metadata
namespaces and keys (Gateway API Inference Extension v1.0.0 and llm-d conventions)."""

from __future__ import annotations

# Picker -> proxy: where to send the request (an ip:port, or an ordered comma list whose later
# entries are fallbacks). Set as a request header AND as dynamic metadata; the two must agree.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
DESTINATION_KEY = DESTINATION_HEADER

# Proxy -> picker: the subset of endpoints the picker may choose from.
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"

# Proxy -> picker (response path): the endpoint that really served.
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Headers the client may not set: they would choose the upstream or spoof a hint.
PICKER_OWNED_HEADERS = frozenset({DESTINATION_HEADER, SUBSET_HINT_KEY})

REQUEST_ID_HEADER = "x-request-id"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
MODEL_REWRITE_HEADER = "x-llm-d-model-name-rewrite"
# vLLM's request priority header (read before the body's `priority`): with
# `flow_control.engine_priority` the picker sets it to the band (`header`) or removes the
# client's while writing the band into the body (`body`).
ENGINE_PRIORITY_HEADER = "x-vllm-priority"

# Operator-only explanation: a request whose `x-extproc-explain` carries one of
# `server.explain_tokens` gets its decision back as JSON in the `x-extproc-decision` response
# header (nobody by default; generated Envoy configs strip both at the edge).
EXPLAIN_HEADER = "x-extproc-explain"
DECISION_HEADER = "x-extproc-decision"

# Where the request path is when `:path` is missing (a proxy that rewrote it keeps the original
# here), in order after `:path`.
PATH_FALLBACK_HEADERS = ("x-envoy-original-path", "x-original-path")

# Disaggregation (llm-d's P/D and E/P/D, data parallel): picker -> the decode server's sidecar,
# which endpoint runs the other stage.
PREFILLER_HEADER = "x-prefiller-host-port"
ENCODERS_HEADER = "x-encoder-hosts-ports"
DATA_PARALLEL_HEADER = "x-data-parallel-host-port"

# Client -> picker: session affinity (the session-affinity scorer's default header; the
# endpoint it names is base64-encoded).
SESSION_TOKEN_HEADER = "x-session-token"

# Client -> picker: objective, fairness and latency SLOs, llm-d's name first, then GIE's /
# the older one. Flow control and the latency plugins read them.
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
TTFT_SLO_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
TPOT_SLO_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")

# Picker -> proxy (request): the latency plugins' prediction for the chosen endpoint.
PREDICTED_TTFT_HEADER = "x-extproc-predicted-ttft-ms"

# Client -> picker: video facts the body cannot tell (token estimate of a video item).
VIDEO_FPS_HEADER = "x-llm-d-video-fps"
VIDEO_DURATION_HEADER = "x-llm-d-video-duration-seconds"
VIDEO_RESOLUTION_HEADER = "x-llm-d-video-resolution"

# Admin port's explain endpoint: the request path the posted body is explained for.
EXPLAIN_PATH_HEADER = "x-extproc-path"

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXT_PROC_METHOD = f"/{EXT_PROC_SERVICE}/Process"

# Health service names the proxy and Kubernetes probe; GIE's and llm-d's Helm charts probe
# `inference-extension`.
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE, "inference-extension")

# Envoy applies body mutations in chunks; the reference picker uses 62,000 bytes to stay under
# the 64 KiB frame Envoy buffers per streamed body response.
BODY_CHUNK_BYTES = 62_000
