# shellcheck shell=bash
# Shared by every megatron-lol sbatch script: settings, rendezvous, launch, requeue.
#
# Every cluster-specific value is a variable with a default; set it in the
# environment of `sbatch` (exported to the job) or let submit_pipeline.sh pass it.
# Resource requests (partition, account, time, GPUs) cannot be variables inside
# #SBATCH lines: give them on the sbatch command line or through sbatch's own
# input variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS, SBATCH_TIMELIMIT,
# SBATCH_GPUS_PER_NODE, ...), which submit_pipeline.sh does from the variables below.
#
#   MEGATRON_LOL_ROOT   repository root on the compute nodes  (default: $SLURM_SUBMIT_DIR)
#   MEGATRON_LOL_PYTHON python with megatron-lol installed    (default: $MEGATRON_LOL_ROOT/.venv/bin/python,
#                                                               `python` inside a container)
#   GPUS_PER_NODE       GPUs per node; 0 = CPU nodes (gloo)    (default: 0 without nvidia-smi, else its count)
#   PROCS_PER_NODE      training processes per node            (default: GPUS_PER_NODE, 1 on CPU nodes)
#   LAUNCHER            torchrun: one Slurm task per node running torchrun (needs --ntasks-per-node=1)
#                       srun:     one Slurm task per process (needs --ntasks-per-node=PROCS_PER_NODE)
#                                                              (default: torchrun)
#   MASTER_PORT         rendezvous port on the first node      (default: 20000 + job id mod 20000)
#   REQUEUE_EXIT_CODE   status of a run that saved on SIGTERM/SIGUSR1/time limit (default: 85)
#   MAX_REQUEUES        give up requeueing after this many restarts (default: 20)
#   OMP_NUM_THREADS     CPU threads per process                (default: cpus per task / processes per task)
#   CONTAINER_IMAGE     pyxis/enroot image; empty = no container (default: empty)
#   CONTAINER_MOUNTS    --container-mounts value               (default: $MEGATRON_LOL_ROOT:$MEGATRON_LOL_ROOT)
#   CONTAINER_EXTRA     more srun container flags              (default: empty)
#   NCCL_* / GLOO_SOCKET_IFNAME: see lol_network_env below; anything you export wins.

set -euo pipefail

MEGATRON_LOL_ROOT="${MEGATRON_LOL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
export MEGATRON_LOL_ROOT
cd "$MEGATRON_LOL_ROOT"

CONTAINER_IMAGE="${CONTAINER_IMAGE:-}"
CONTAINER_MOUNTS="${CONTAINER_MOUNTS:-$MEGATRON_LOL_ROOT:$MEGATRON_LOL_ROOT}"
CONTAINER_EXTRA="${CONTAINER_EXTRA:-}"
if [ -z "${MEGATRON_LOL_PYTHON:-}" ]; then
    if [ -n "$CONTAINER_IMAGE" ]; then MEGATRON_LOL_PYTHON=python
    else MEGATRON_LOL_PYTHON="$MEGATRON_LOL_ROOT/.venv/bin/python"; fi
fi
export MEGATRON_LOL_PYTHON
if [ -z "$CONTAINER_IMAGE" ] && [ ! -x "$MEGATRON_LOL_PYTHON" ] && ! command -v "$MEGATRON_LOL_PYTHON" >/dev/null; then
    echo "megatron-lol: $MEGATRON_LOL_PYTHON not found: run tools/setup_env.sh or set MEGATRON_LOL_PYTHON" >&2
    exit 2
fi

if [ -z "${GPUS_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l)
    else GPUS_PER_NODE=0; fi
fi
if [ -z "${PROCS_PER_NODE:-}" ]; then
    if [ "$GPUS_PER_NODE" -gt 0 ]; then PROCS_PER_NODE=$GPUS_PER_NODE; else PROCS_PER_NODE=1; fi
fi
LAUNCHER="${LAUNCHER:-torchrun}"
REQUEUE_EXIT_CODE="${REQUEUE_EXIT_CODE:-85}"
MAX_REQUEUES="${MAX_REQUEUES:-20}"
export GPUS_PER_NODE PROCS_PER_NODE LAUNCHER

lol_log() { echo "[megatron-lol $(date +%T) job ${SLURM_JOB_ID:-?}${SLURM_RESTART_COUNT:+ restart $SLURM_RESTART_COUNT}] $*"; }

# ------------------------------------------------------------------ environment
lol_network_env() {
    if [ "$GPUS_PER_NODE" -gt 0 ]; then
        # Megatron: kernels of TP/SP communication must queue in order
        export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
        export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
        export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
        export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
        # InfiniBand (H100/H800 clusters): long IB timeout for large jobs; the HCA list, socket
        # interface and GID index (RoCE: usually 3) are site values: exported only when set.
        export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
        export NCCL_IB_RETRY_CNT="${NCCL_IB_RETRY_CNT:-7}"
        for v in NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_IB_SL NCCL_NET_GDR_LEVEL \
                 NCCL_IB_QPS_PER_CONNECTION NCCL_NVLS_ENABLE NCCL_CROSS_NIC NCCL_ALGO NCCL_PROTO; do
            if [ -n "${!v:-}" ]; then export "${v?}"; fi
        done
    fi
    if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export GLOO_SOCKET_IFNAME; fi
    local procs_per_task=$PROCS_PER_NODE
    [ "$LAUNCHER" = srun ] && procs_per_task=1
    if [ -z "${OMP_NUM_THREADS:-}" ]; then
        local cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
        OMP_NUM_THREADS=$(( cpus / procs_per_task > 0 ? cpus / procs_per_task : 1 ))
    fi
    export OMP_NUM_THREADS
    export PYTHONUNBUFFERED=1
}

lol_rendezvous() {
    MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
    MASTER_PORT="${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-0} % 20000 ))}"
    export MASTER_ADDR MASTER_PORT
}

# ------------------------------------------------------------------ launch
# lol_srun VERB ARGS...: run `megatron-lol VERB ARGS` on every node of the job, as
# one torchrun per node or one task per process; returns the srun status.
lol_srun() {
    lol_network_env
    lol_rendezvous
    local ntasks_per_node=1
    [ "$LAUNCHER" = srun ] && ntasks_per_node=$PROCS_PER_NODE
    local container=()
    if [ -n "$CONTAINER_IMAGE" ]; then
        container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
                   --container-workdir="$MEGATRON_LOL_ROOT")
        # shellcheck disable=SC2206
        container+=($CONTAINER_EXTRA)
    fi
    lol_log "launch: $LAUNCHER, ${SLURM_JOB_NUM_NODES:-1} node(s) x $PROCS_PER_NODE process(es), GPUs/node $GPUS_PER_NODE," \
            "rendezvous $MASTER_ADDR:$MASTER_PORT, python $MEGATRON_LOL_PYTHON"
    local rc=0
    srun --nodes="${SLURM_JOB_NUM_NODES:-1}" --ntasks-per-node="$ntasks_per_node" --kill-on-bad-exit=1 \
         "${container[@]}" bash "$MEGATRON_LOL_ROOT/slurm/launch_task.sh" "$@" || rc=$?
    return $rc
}

# lol_train_and_requeue SAVE_DIR TRAIN_ARGS...: train, then requeue this job when the
# run saved because of a preemption signal or its time limit (status 85 or marker file).
lol_train_and_requeue() {
    local save_dir=$1; shift
    local rc=0
    lol_srun train "$@" || rc=$?
    local marker="$save_dir/REQUEUE_REQUESTED"
    if [ "$rc" -eq "$REQUEUE_EXIT_CODE" ] || [ -f "$marker" ]; then
        local why=""; [ -f "$marker" ] && why=$(cat "$marker")
        rm -f "$marker"
        if [ "${SLURM_RESTART_COUNT:-0}" -ge "$MAX_REQUEUES" ]; then
            lol_log "checkpoint saved ($why) but MAX_REQUEUES=$MAX_REQUEUES reached: not requeueing"
            return "$REQUEUE_EXIT_CODE"
        fi
        lol_log "checkpoint saved ($why, status $rc): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        # the requeue ends this batch script; do not report a failure meanwhile
        sleep 300
        return 0
    fi
    if [ "$rc" -ne 0 ]; then lol_log "training failed with status $rc"; fi
    return "$rc"
}
