#!/usr/bin/env bash
# One entry point for a fresh machine.
#   ./dev.sh setup        create .venv (uv), install fleet with its test + transformers extras
#   ./dev.sh demo [ARGS]  setup, then `fleet demo ARGS` (the main job on the embedded Prefect server)
#   ./dev.sh test [ARGS]  setup, install openssh-server, sshfs and chromium when missing, then two steps, both
#                         reported at the end: the type check (mypy, strict on fleet/, cached), then the test
#                         suite in 4 parallel workers. ARGS go to pytest (-n N: N workers; -n 0: serially; a
#                         path: only those tests); the type check runs whatever ARGS say (seconds when its cache
#                         is warm). Exit status: non-zero when either step failed. FLEET_TEST_MYPY=0 skips the
#                         type check; FLEET_TEST_SLOWDOWN=F fixes the factor every test deadline is multiplied by
#                         (default: measured from the machine's load at start; README, Tests).
#   ./dev.sh typecheck    setup, then only the type check
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

typecheck() {
  # Its own step, not a test: a cold run is ≈ 75 s of CPU (minutes of wall on a loaded 2-core machine),
  # and no deadline belongs on it. The cache is one per user in the temp dir, shared by every checkout and
  # run on the machine under an flock (CI's fresh clone has no .mypy_cache/); mypy keys it by each file's
  # contents and the options, so a warm run finds what a cold one does.
  local cache="${TMPDIR:-/tmp}/fleet-test-mypy-$(id -u)"
  mkdir -p -m 700 "$cache"
  echo "dev.sh: type check: mypy, strict on fleet/ (pyproject.toml), cache $cache/cache" >&2
  flock "$cache/.lock" "$VENV/bin/python" -m mypy --cache-dir "$cache/cache"
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
    # --timeout is scaled by the slowdown factor too (tests/harness.py).
    mypy_rc=skipped
    if [ "${FLEET_TEST_MYPY:-1}" != 0 ]; then
      mypy_rc=0; typecheck || mypy_rc=$?
    fi
    pytest_rc=0
    "$VENV/bin/python" -m pytest -n 4 --dist loadgroup --no-loadscope-reorder --timeout 900 "$@" || pytest_rc=$?
    word() { case "$1" in 0) echo passed ;; skipped) echo "skipped (FLEET_TEST_MYPY=0)" ;; *) echo "FAILED (exit $1)" ;; esac; }
    echo "dev.sh: type check $(word "$mypy_rc"); tests $(word "$pytest_rc")" >&2
    [ "$pytest_rc" = 0 ] || exit "$pytest_rc"
    [ "$mypy_rc" = 0 ] || [ "$mypy_rc" = skipped ] || exit 1
    ;;
  typecheck) setup; typecheck ;;
  help|-h|--help) usage ;;
  *) echo "dev.sh: unknown command '$cmd'" >&2; usage >&2; exit 2 ;;
esac
