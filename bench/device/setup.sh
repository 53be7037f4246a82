# Sourced first by every device call: `. bench/device/setup.sh NAME` (or the carried copy `. .carry/setup.sh NAME`).
# Installs the carried wheels (.carry/lead/*.whl) into /tmp/site, sets C=.carry/NAME, T0 and `el MSG`
# (seconds since start + MSG). If $C/tree.tar.xz exists (a helper branch packed by pack.sh), runs from it.
T0=$(date +%s); C=$PWD/.carry/$1
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/lead/*.whl \
  > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; return 1 2>/dev/null || exit 1; }
if [ -f $C/tree.tar.xz ]; then mkdir -p /tmp/tree && tar -xJf $C/tree.tar.xz -C /tmp/tree && cd /tmp/tree; fi
export PYTHONPATH=/tmp/site:$PWD
el "setup done in $PWD ($(python3 -c 'import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' 2>&1 | tail -1))"
