# Source this on an air-gapped GPU machine before running the repo's GPU steps:
#   source scripts/staging/device_env.sh
# It makes the monorepo importable without installing (the machine has torch+triton but no internet) and installs
# any wheels copied into .whl/ (see scripts/staging/fetch_device_wheels.sh) into /tmp/site; FA4 from /tmp/fa4site if installed
# (scripts/staging/fa4_device_wheels.sh).
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | tr '\n' ':')$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# FlashAttention 4, when scripts/staging/fa4_device_wheels.sh install has put it in /tmp/fa4site: a --target install does not
# run the DSL's .pth file, which puts nvidia_cutlass_dsl/dsl_packages (the `cutlass` package) on sys.path.
if [ -d /tmp/fa4site/nvidia_cutlass_dsl/dsl_packages ]; then
  export PYTHONPATH="/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:/tmp/fa4site:$PYTHONPATH"
fi
python3 -c "import torch, triton; print('device env:', torch.__version__, triton.__version__, torch.cuda.get_device_name())"
