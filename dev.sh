#!/usr/bin/env bash
# One entry point for a fresh machine.
#   ./dev.sh setup        create .venv (uv), install fleet with its test + transformers extras
#   ./dev.sh demo [ARGS]  setup, then `fleet demo ARGS` (the main job on the embedded Prefect server)
#   ./dev.sh test [ARGS]  setup, install openssh-server, sshfs and chromium when missing, then run the whole test suite
#                         in 4 parallel workers (ARGS -n N: N workers; -n 0: serially)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${FLEET_VENV:-.venv}
PY=${FLEET_PYTHON:-python3}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

find_uv() {
  # pip --user puts uv in the user base's bin (~/.local/bin), often not on PATH: look there
  # too, or every call would install it again.
  local user_base
  user_base=$("$PY" -c 'import site; print(site.getuserbase())' 2>/dev/null || echo "$HOME/.local")
  export PATH="$PATH:$user_base/bin:$HOME/.local/bin"
  command -v uv >/dev/null 2>&1
}

setup() {
  local stamp="$VENV/.fleet-setup"
  local want
  want=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  if ! find_uv; then
    echo "dev.sh: installing uv (pip --user)" >&2
    # PIP_ROOT_USER_ACTION: as root there is no other user to protect; skip pip's warning about it
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet --user uv \
      || PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --quiet uv
    find_uv || { echo "dev.sh: uv was installed but is not on PATH nor in the user base's bin" >&2; exit 1; }
  fi
  [ -x "$VENV/bin/python" ] || uv venv --quiet --python "$("$PY" -c 'import sys; print(sys.executable)')" "$VENV"
  export VIRTUAL_ENV="$PWD/$VENV"
  # torch: take a local CPU wheel when the machine has one (a plain 'torch' pulls a multi-GB CUDA build).
  local links=()
  for d in ${FLEET_WHEELS:-/opt/wheels}; do [ -d "$d" ] && links+=(--find-links "$d"); done
  if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    local cpu_torch
    cpu_torch=$(ls ${FLEET_WHEELS:-/opt/wheels}/torch-*+cpu-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$cpu_torch" ]; then
      uv pip install --quiet --compile-bytecode "${links[@]}" "$cpu_torch"
    else
      uv pip install --quiet --compile-bytecode --index-url https://download.pytorch.org/whl/cpu torch \
        || uv pip install --quiet --compile-bytecode torch
    fi
  fi
  uv pip install --quiet --compile-bytecode "${links[@]}" -e ".[transformers,test]"
  echo "$want" > "$stamp"
}

need_test_tools() {
  # a real sshd on 127.0.0.1 for the SSH tests; sshfs for a real network filesystem
  local missing=()
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v sshfs >/dev/null 2>&1 || missing+=(sshfs)
  # headless Chromium reads the Prefect UI in tests/test_ui.py (what an operator sees)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "dev.sh: installing ${missing[*]} (the tests use them for real)" >&2
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || {
    $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  }
}

cmd=${1:-help}; shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$VENV/bin/fleet" demo "$@" ;;
  test)
    setup; need_test_tools
    # In parallel: the tests mostly wait (on servers, Prefect, processes), so more workers than
    # cores. loadgroup keeps each module with a costly module-wide server on one worker;
    # conftest.py orders the longest tests first (hence no reordering here). A later -n wins.
    # --timeout: pytest-timeout's hang guard (300 s in pyproject) with room for a long test slowed by
    # the others beside it (the deployment tests reached 290 s with 4 workers on a busy machine).
    exec "$VENV/bin/python" -m pytest -n 4 --dist loadgroup --no-loadscope-reorder --timeout 900 "$@" ;;
  help|-h|--help) usage ;;
  *) echo "dev.sh: unknown command '$cmd'" >&2; usage >&2; exit 2 ;;
esac
