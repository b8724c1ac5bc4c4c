#!/usr/bin/env bash
# Build llama.cpp (the tree vendored in the llama-cpp-python sdist) into a cache folder: native, Release,
# only the llama-bench, llama-server and llama-quantize targets. Niced and -j2 by default because the
# machines this runs on are shared. Prints one "SKIP: ..." line and exits 0 where it cannot build.
#
#   bench/llamacpp/build.sh            # env: LLAMACPP_CACHE (~/.cache/llminfer/llamacpp), JOBS (2), PIP
#   ISA=avx2 bench/llamacpp/build.sh   # a second build into build-avx2: GGML_NATIVE=OFF, only AVX/AVX2/FMA/F16C/BMI2,
#                                      # so that the AVX2 class can be measured on an AVX-512 machine
set -euo pipefail
CACHE="${LLAMACPP_CACHE:-$HOME/.cache/llminfer/llamacpp}"
JOBS="${JOBS:-2}"
PIP="${PIP:-pip}"
read -ra PIP_CMD <<< "$PIP"  # PIP may be a command line such as "python -m pip"
for tool in cmake c++ cc; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "SKIP: llama.cpp peer benchmark: '$tool' not found (install cmake and a C/C++ compiler, e.g. 'pip install cmake' and build-essential)"
    exit 0
  fi
done
ISA="${ISA:-native}"
case "$ISA" in
  native) BUILD="$CACHE/build"; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD="$CACHE/build-avx2"
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "ISA must be native or avx2, got '$ISA'" >&2; exit 2 ;;
esac
BIN="$BUILD/bin"
if [[ -x "$BIN/llama-bench" && -x "$BIN/llama-server" && -x "$BIN/llama-quantize" && -x "$BIN/llama-perplexity" ]]; then
  echo "llama.cpp already built in $BIN"; exit 0
fi
mkdir -p "$CACHE/src"
SDIST=$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
if [[ -z "$SDIST" ]]; then
  "${PIP_CMD[@]}" download --no-binary :all: --no-deps llama-cpp-python -d "$CACHE/src" \
    || { echo "SKIP: llama.cpp peer benchmark: could not download the llama-cpp-python sdist"; exit 0; }
  SDIST=$(ls "$CACHE"/src/llama_cpp_python-*.tar.gz | sort -V | tail -1)
fi
TOP="${SDIST%.tar.gz}"
[[ -d "$TOP" ]] || tar xzf "$SDIST" -C "$CACHE/src"
ln -sfn "$TOP/vendor/llama.cpp" "$CACHE/llama.cpp"
start=$(date +%s)
nice -n 19 cmake -S "$CACHE/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-bench llama-server llama-quantize llama-perplexity
end=$(date +%s)
echo "$((end - start))" > "$BUILD/build_seconds.txt"
echo "llama.cpp ($ISA) built in $((end - start)) s (jobs=$JOBS, load average at end: $(cut -d' ' -f1-3 /proc/loadavg)) -> $BIN"
