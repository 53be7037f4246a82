# Builds the git-ignored .carry/lead folder that device calls carry (docs/architecture.md, "Device calls"):
# wheels of every runtime and test dependency the GPU machine's image lacks (it has torch, triton, numpy and
# transformers; nothing can be fetched there), the default model's tokenizer and config (lead/tok), layer 3's packed
# weights and 32 real inputs (lead/packed, bench/gpu_packed.py --weights) and layers 2-3 for bench/gpu_attention.py
# (lead/smollm2). Run from the repo root, in the project's venv, after `cipherlm model pull` (~1 min, ~45 MB).
#     bash bench/device/make_carry.sh
set -e
python -c "import tenseal, engine" 2>/dev/null || { echo "run it in the project's venv, from the repo root"; exit 1; }
L=.carry/lead; mkdir -p $L
PKGS="annotated-types anyio attrs certifi cffi click cryptography fastapi gguf h11 httpcore httptools httpx hypothesis
idna importlib-metadata iniconfig jiter openai opentelemetry-api platformdirs pluggy prometheus-client py-spy pycparser
pydantic pydantic-core pydantic-settings pytest pytest-asyncio python-dotenv rfc8785 sniffio sortedcontainers starlette
tenseal typing-extensions typing-inspection uvicorn uvloop xgrammar zipp zstandard"
# the versions installed here, so the device runs what the tests ran against
pins=$(python -m pip list --format=freeze 2>/dev/null | python -c "
import sys; want = {w.lower().replace('_', '-') for w in sys.argv[1].split()}
have = {l.strip().split('==')[0].lower().replace('_', '-'): l.strip() for l in sys.stdin if '==' in l}
print(' '.join(have.get(w, w) for w in sorted(want)))" "$PKGS")  # not installed here (a 3.12-only need): unpinned
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d $L $pins
M=$(python -c "from engine.default_model import default_model_dir; print(default_model_dir())" 2>/dev/null \
    || echo ~/.cache/cipherlm/models/SmolLM2-135M-Instruct)
mkdir -p $L/tok && cp $M/chat_template.jinja $M/config.json $M/tokenizer.json $M/tokenizer_config.json $L/tok/
PYTHONPATH=. python bench/gpu_packed.py --export $L/packed
PYTHONPATH=. python bench/gpu_attention.py --export $L/smollm2
du -sh $L
