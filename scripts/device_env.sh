# Source this on the GPU device (the `device` tool's machine) at the start of every call:
#   source scripts/device_env.sh
# It makes the monorepo importable without installing (the machine has torch+triton but no internet) and installs
# any wheels carried in .whl/ (see scripts/fetch_device_wheels.sh) into /tmp/site.
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | tr '\n' ':')$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import torch, triton; print('device env:', torch.__version__, triton.__version__, torch.cuda.get_device_name())"
