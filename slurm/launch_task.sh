#!/usr/bin/env bash
# One Slurm task of a megatron-lol job (called by lol_srun in common.sh):
#   LAUNCHER=torchrun: torchrun for PROCS_PER_NODE processes of this node;
#   LAUNCHER=srun:     this task is one rank (RANK/WORLD_SIZE/LOCAL_RANK from Slurm).
# Usage: launch_task.sh VERB ARGS...  (runs `megatron-lol VERB ARGS`)
set -euo pipefail
PY="${MEGATRON_LOL_PYTHON:-python}"
case "${LAUNCHER:-torchrun}" in
    torchrun)
        # Slurm signals every process of the step (--signal=USR1@T, scancel -s USR1): the
        # training processes catch SIGUSR1 and save; torchrun itself would die of it (default
        # action) and take its workers down mid-save, so it ignores it (the workers install
        # their own handler). SIGTERM is forwarded by torchrun, which waits 30 s.
        trap '' USR1
        exec "$PY" -m torch.distributed.run \
            --nnodes="${SLURM_JOB_NUM_NODES:-1}" --node-rank="${SLURM_NODEID:-0}" \
            --nproc-per-node="${PROCS_PER_NODE:-1}" \
            --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
            -m megatron_lol "$@"
        ;;
    srun)
        export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
        export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-1}"
        LOCAL_WORLD_SIZE="${LOCAL_WORLD_SIZE%%(*}"
        exec "$PY" -m megatron_lol "$@"
        ;;
    *)
        echo "launch_task.sh: LAUNCHER must be torchrun or srun (got $LAUNCHER)" >&2
        exit 2
        ;;
esac
