#!/usr/bin/env bash
# GPU checks on one CUDA machine, in one go: the CUDA training path, the fast tests with CUDA visible
# (CUDA env tensors, pinned-memory snapshots), throughput at Isaac Lab-like env counts, and the
# gradient-sync bench on NCCL. Usage: bash bench/gpu_check.sh OUT_DIR   (each step time-boxed)
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export OMP_NUM_THREADS=4
py=${PYTHON:-python3}
{ nvidia-smi -L; $py -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; } > "$out/gpu.txt" 2>&1
step() { name=$1; limit=$2; shift 2; s=$(date +%s); timeout "$limit" "$@" > "$out/$name.txt" 2>&1;
         echo "$name rc=$? ${SECONDS}s total, $(( $(date +%s) - s ))s" | tee -a "$out/summary.txt"; }
step train_cuda_4096 90 $py train.py tracking --env.num-envs 4096 --max-iterations 40 --log.root /tmp/gpu_runs --log.print-every 5
step train_cuda_16384_bucketed 60 $py train.py tracking --env.num-envs 16384 --max-iterations 10 --dist.grad-sync bucketed --log.root /tmp/gpu_runs --log.print-every 2
step torchrun_nccl_1gpu 45 torchrun --standalone --nproc-per-node 1 train.py cartpole --max-iterations 20 --log.root /tmp/gpu_runs --log.print-every 5
step pytest_fast 150 $py -m pytest -q -m "not slow" tests -p no:cacheprovider --ignore=tests/test_env_gymnasium.py
step bench_grad_cuda 240 $py bench/bench_grad_sync.py --device cuda --iters 10
