# Sourced by the setup scripts: sets UV to a working uv command, installing uv if needed.
# Works on a stock Debian 12, whose python3 refuses `pip install` outside a venv (PEP 668) and
# ships without pip and ensurepip: uv then goes into a venv of its own under ~/.cache.
find_uv() {
  if command -v uv >/dev/null 2>&1; then UV="uv"; return; fi
  if python3 -m uv --version >/dev/null 2>&1; then UV="python3 -m uv"; return; fi
  local tools="${XDG_CACHE_HOME:-$HOME/.cache}/extproc/uv-venv"
  if [ ! -x "$tools/bin/uv" ]; then
    if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
      local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
    fi
    python3 -m venv "$tools"
    "$tools/bin/python" -m pip install -q uv
  fi
  UV="$tools/bin/uv"
}
find_uv
