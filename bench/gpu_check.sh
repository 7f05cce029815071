#!/usr/bin/env bash
# GPU checks on one CUDA machine, in one go, each step time-boxed so that one hang costs only its box.
#
#   bash bench/gpu_check.sh OUT_DIR [PART ...]      # default: learner sync (time boxes total 505 s)
#
# Parts:
#   learner  the open GPU targets of the learner (docs/gpu.md): the CUDA-graph minibatch step's
#            exactness tests on CUDA, then syncppo vs RSL-RL interleaved on the GPU at 4096 envs with
#            (512, 256, 128) networks (host path, then --ppo.capture-step), and env-steps/s at 16,384 envs
#            (those networks with and without capture, then the preset's (128, 128) with capture)
#   sync     weight sync with the weights on the GPU: the exactness tests (host and GPU snapshot), then the
#            bench with the patch snapshot on the GPU (2 gloo ranks sharing it)
#   train    the CUDA training path end to end (4096 envs; 16,384 envs bucketed; under torchrun at 1 rank, which
#            makes no process group: NCCL between ranks needs 2 or more GPUs)
#   tests    the fast tests with CUDA visible (CUDA env tensors, pinned-memory snapshots)
#   grad     the gradient-sync bench on NCCL (one process per visible GPU)
#
# A bare GPU machine lacks tyro and rsl-rl-lib: run `make gpu-wheels` here first and carry .whl there;
# this script installs .whl/*.whl into /tmp/site when the folder is present. Through a remote-run tool
# that returns a folder OUT: command `bash bench/gpu_check.sh $OUT`, carrying `.whl`, with a 540 s limit.
# Python: .venv/bin/python when present, else python3; PYTHON=... overrides.
# What comes back: gpu.txt, summary.txt (one line per step: exit status and seconds) and one log per part.
# Exit status 1 when CUDA was not usable, a step failed or a part is unknown (every part still runs).
set -u
out=${1:-gpu_out}
shift || true
parts=${*:-learner sync}
mkdir -p "$out"
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
export GIT_PYTHON_REFRESH=quiet   # rsl-rl imports GitPython, which otherwise fails without a git executable
# The Makefile's .venv when this checkout has one (a GPU box after `make setup`), else the python3 on PATH (a bare
# machine with .whl); PYTHON=... picks another. torchrun runs as that interpreter's module, so it is the same one.
if [ -x .venv/bin/python ]; then py=${PYTHON:-.venv/bin/python}; else py=${PYTHON:-python3}; fi
if [ -d .whl ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
failed=0
nvidia-smi -L > "$out/gpu.txt" 2>&1 || failed=1
$py -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" >> "$out/gpu.txt" 2>&1 || failed=1
[ $failed = 0 ] || echo "no usable CUDA device: see gpu.txt" | tee -a "$out/summary.txt"
# One log per part (the device tool brings back at most 8 files), each step under a header line.
step() { name=$1; limit=$2; shift 2; s=$(date +%s); echo "===== $name: $*" >> "$out/$part.txt";
         timeout "$limit" "$@" >> "$out/$part.txt" 2>&1; rc=$?; [ $rc = 0 ] || failed=$((failed + 1));
         echo "$name rc=$rc ${SECONDS}s total, $(( $(date +%s) - s ))s" | tee -a "$out/summary.txt"; }
big="--policy.actor-hidden 512 256 128 --policy.critic-hidden 512 256 128"
runs="--log.root /tmp/gpu_runs --log.save-every 1000000"
for part in $parts; do
    case $part in
    learner)
        SYNCPPO_TEST_DEVICE=cuda step capture_tests 60 $py -m pytest -q -p no:cacheprovider tests/test_minibatch_step.py tests/test_host_reads.py tests/test_rollout_update_formulas.py::test_time_out_bootstrap_by_hand_on_the_test_device
        step bench_train_host 90 $py bench/bench_train.py --device cuda --settings large
        step bench_train_capture 90 $py bench/bench_train.py --device cuda --settings large --capture-step
        step train_16384_capture 45 $py train.py tracking --env.num-envs 16384 $big --ppo.capture-step --max-iterations 12 --log.print-every 1 $runs
        step train_16384_host 45 $py train.py tracking --env.num-envs 16384 $big --max-iterations 12 --log.print-every 1 $runs
        step train_16384_preset_capture 40 $py train.py tracking --env.num-envs 16384 --ppo.capture-step --max-iterations 12 --log.print-every 1 $runs ;;
    sync)
        SYNCPPO_TEST_DEVICE=cuda step sync_tests_cuda 60 $py -m pytest -q -p no:cacheprovider tests/test_sync_patch.py tests/test_sync_bucket.py tests/test_checksum_reference.py -k "every_update or load_instant or test_device"
        step bench_sync_cuda 75 $py bench/bench_sync.py --device cuda --densities 0.001 0.01 0.1 1.0 --repeats 5 ;;
    train)
        step train_cuda_4096 90 $py train.py tracking --env.num-envs 4096 --max-iterations 40 --log.print-every 5 $runs
        step train_cuda_16384_bucketed 60 $py train.py tracking --env.num-envs 16384 --max-iterations 10 --dist.grad-sync bucketed --log.print-every 2 $runs
        step torchrun_1gpu 45 $py -m torch.distributed.run --standalone --nproc-per-node 1 train.py cartpole --max-iterations 20 --log.print-every 5 $runs ;;
    tests)
        step pytest_fast 150 $py -m pytest -q -m "not slow" tests -p no:cacheprovider --ignore=tests/test_env_gymnasium.py ;;
    grad)
        step bench_grad_cuda 240 $py bench/bench_grad_sync.py --device cuda --iters 10 ;;
    *)
        failed=$((failed + 1))
        echo "unknown part $part (learner, sync, train, tests, grad)" | tee -a "$out/summary.txt" ;;
    esac
done
[ $failed = 0 ] || { echo "$failed failed (see summary.txt)" | tee -a "$out/summary.txt"; exit 1; }
