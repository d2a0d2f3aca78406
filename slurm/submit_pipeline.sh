#!/usr/bin/env bash
# Submit the whole pipeline, each stage starting only when the previous one succeeded
# (--dependency=afterok, --kill-on-invalid-dep=yes: a failed stage cancels the stages after
# it instead of leaving them pending forever on clusters without kill_invalid_depend):
#
#   preprocess (array over NUM_SHARDS shards) -> merge -> pretrain -> context extension
#
# Every stage's configuration is validated first: its parallel layout and batch sizes against
# NODES x PROCS_PER_NODE (`megatron-lol plan-layout --check`: when they do not fit, status 2 with
# the planner's first proposal), then `megatron-lol train --dry-run=config` (every key, the
# tokenizer), and the preprocess array's `megatron-lol preprocess --dry-run` (INPUT, parquet
# columns, the tokenizer); nothing is submitted unless all pass. The tokenizer is the pretraining
# config's (data.tokenizer_type / data.tokenizer_model) unless TOKENIZER_TYPE / TOKENIZER_MODEL say
# otherwise; one given by Hub name is fetched here and the jobs run with HF_HUB_OFFLINE=1.
# Run it from any directory: relative paths are relative to it, and the jobs run there.
#
#   megatron-lol plan-layout --config /repo/examples/configs/paper/lol-360m-L4.yaml \
#       --nodes 16 --gpus-per-node 8 --device-memory 80 --output lol-360m-L4-16x8.yaml
#   INPUT='/data/raw/*.jsonl.zst' TOKENIZER_TYPE=HuggingFaceTokenizer \
#   TOKENIZER_MODEL=/data/gpt-neox-20b/tokenizer.json NUM_SHARDS=64 \
#   PARTITION=h100 ACCOUNT=myproj NODES=16 GPUS_PER_NODE=8 CPUS_PER_NODE=96 DEVICE_MEMORY=80 \
#   PRETRAIN_CONFIG=lol-360m-L4-16x8.yaml CONTEXT_CONFIG= \
#   WORK_DIR=/lustre/me/lol360m bash /repo/slurm/submit_pipeline.sh
#
# Variables (defaults):
#   INPUT             corpus files / glob / directory for preprocess      (required)
#                     (.jsonl[.gz|.zst], .parquet with a `text` column, .txt)
#   TOKENIZER_TYPE    tokenizer of every stage       (PRETRAIN_CONFIG's data.tokenizer_type)
#   TOKENIZER_MODEL   a file, or a Hub name such as EleutherAI/gpt-neox-20b (PRETRAIN_CONFIG's data.tokenizer_model)
#   NUM_SHARDS        preprocess array size                                (4)
#   PREPROCESS_CPUS   CPUs per preprocess task (= tokenizer workers)       (4)
#   WORK_DIR          data/, pretrain/, context_ext/, logs/, jobs.env go here (runs/pipeline)
#   DATA_PREFIX       the dataset preprocess writes and training reads, ending in _text_document,
#                     e.g. data/paper/fineweb_text_document (the paper configs')
#                                                      ($WORK_DIR/data/corpus_text_document)
#   DATA_ONLY         1 = submit the preprocess array and the merge only   (0)
#   PRETRAIN_CONFIG   ($REPO/examples/configs/tiny-slurm.yaml)
#   CONTEXT_CONFIG    ($REPO/examples/configs/tiny-context-ext.yaml); empty = no context-extension stage
#   NODES             nodes for pretrain and context extension           (2)
#   GPUS_PER_NODE     GPUs per node, 0 = CPU nodes with gloo                (0 without nvidia-smi, else 8)
#   PROCS_PER_NODE    training processes per node                         (GPUS_PER_NODE, or 1)
#   CPUS_PER_NODE     CPUs for training on each node, whatever the launch style: torchrun's
#                     one task per node gets them all, srun's PROCS_PER_NODE tasks a share each
#                                                                         (empty: Slurm's default)
#   CPUS_PER_PROCESS  CPUs per training process instead (torchrun: x PROCS_PER_NODE per task)
#                     (CPUS_PER_TASK is refused: it would mean different things for the two styles)
#   LAUNCHER          torchrun | srun (see slurm/common.sh)               (torchrun)
#   PARTITION ACCOUNT QOS   Slurm partition / account / QoS               (empty: cluster defaults)
#   PREPROCESS_TIME PRETRAIN_TIME CONTEXT_TIME   --time limits            (empty: partition default)
#   SBATCH_EXTRA      more sbatch flags for every job, e.g. "--exclusive --mem=0" (empty)
#   PRETRAIN_LAUNCHER / CONTEXT_LAUNCHER   per-stage LAUNCHER override    (LAUNCHER)
#   PRETRAIN_ARGS / CONTEXT_ARGS           extra `megatron-lol train` flags per stage (empty)
#   VALIDATE          1 = dry-run every stage's config before submitting  (1; needs a local python)
#   DEVICE_MEMORY     GiB per GPU: the layout check also compares the memory estimate with it (empty: not)
#   CONTAINER_IMAGE, CONTAINER_MOUNTS, MEGATRON_LOL_PYTHON, NCCL_*: see slurm/common.sh
# Prints the job ids and writes them to $WORK_DIR/jobs.env.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEGATRON_LOL_ROOT="$REPO"
RUN_DIR="$PWD"

die() { echo "submit_pipeline.sh: $*" >&2; exit 2; }
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$RUN_DIR/$1" ;; esac; }

# the submitting shell's rendezvous variables would reach the jobs (sbatch exports everything)
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK

: "${INPUT:?set INPUT to the corpus files}"
NUM_SHARDS="${NUM_SHARDS:-4}"
PREPROCESS_CPUS="${PREPROCESS_CPUS:-4}"
WORK_DIR="$(abspath "${WORK_DIR:-runs/pipeline}")"
PRETRAIN_CONFIG="$(abspath "${PRETRAIN_CONFIG:-$REPO/examples/configs/tiny-slurm.yaml}")"
CONTEXT_CONFIG="${CONTEXT_CONFIG-$REPO/examples/configs/tiny-context-ext.yaml}"
[ -n "$CONTEXT_CONFIG" ] && CONTEXT_CONFIG="$(abspath "$CONTEXT_CONFIG")"
DATA_PREFIX="$(abspath "${DATA_PREFIX:-$WORK_DIR/data/corpus_text_document}")"
case "$DATA_PREFIX" in
    *_text_document) DATA_PREFIX_BASE="${DATA_PREFIX%_text_document}" ;;
    *) die "DATA_PREFIX=$DATA_PREFIX must end in _text_document (preprocess writes PREFIX_text_document)" ;;
esac
DATA_ONLY="${DATA_ONLY:-0}"
PY="${MEGATRON_LOL_PYTHON:-$REPO/.venv/bin/python}"
lol_py() { (cd "$RUN_DIR" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$@"); }
# the tokenizer every stage uses: the pretraining config's unless TOKENIZER_TYPE / TOKENIZER_MODEL are set
TOKENIZER_FROM="TOKENIZER_MODEL"
if [ -z "${TOKENIZER_TYPE:-}" ] || [ -z "${TOKENIZER_MODEL:-}" ]; then
    [ -f "$PRETRAIN_CONFIG" ] || die "PRETRAIN_CONFIG=$PRETRAIN_CONFIG does not exist"
    if ! out=$(lol_py -c 'import sys; from megatron_lol.config import load_config
d = load_config(sys.argv[1], validate=False).data
print(f"tokenizer_type={d.tokenizer_type}\ntokenizer_model={d.tokenizer_model or str()}")' \
               "$PRETRAIN_CONFIG" 2>&1); then
        die "PRETRAIN_CONFIG=$PRETRAIN_CONFIG: $(tail -n 1 <<<"$out") -- nothing submitted"
    fi
    TOKENIZER_TYPE="${TOKENIZER_TYPE:-$(sed -n 's/^tokenizer_type=//p' <<<"$out")}"
    if [ -z "${TOKENIZER_MODEL:-}" ]; then
        TOKENIZER_MODEL="$(sed -n 's/^tokenizer_model=//p' <<<"$out")"
        TOKENIZER_FROM="TOKENIZER_MODEL (data.tokenizer_model of $PRETRAIN_CONFIG)"
    fi
fi
if [ -z "$TOKENIZER_MODEL" ] && [ "$TOKENIZER_TYPE" != GPT2BPETokenizer ]; then
    die "no tokenizer: set TOKENIZER_MODEL (a file, or a Hub name such as EleutherAI/gpt-neox-20b) or" \
        "data.tokenizer_model in $PRETRAIN_CONFIG -- nothing submitted"
fi
# TOKENIZER_MODEL: a local file, or a HuggingFace Hub name (namespace/name, no such local path), which is
# resolved below on this host into the Hub cache (HF_HUB_CACHE / HF_HOME: put it where the compute nodes
# read); the jobs then run with HF_HUB_OFFLINE=1
TOKENIZER_ON_HUB=0
if [ -n "${TOKENIZER_MODEL:-}" ]; then
    if [ ! -e "$(abspath "$TOKENIZER_MODEL")" ] && [[ "$TOKENIZER_MODEL" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
        TOKENIZER_ON_HUB=1
    else
        TOKENIZER_MODEL="$(abspath "$TOKENIZER_MODEL")"
    fi
fi
NODES="${NODES:-2}"
if [ -z "${GPUS_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then GPUS_PER_NODE=8; else GPUS_PER_NODE=0; fi
fi
if [ -z "${PROCS_PER_NODE:-}" ]; then
    if [ "$GPUS_PER_NODE" -gt 0 ]; then PROCS_PER_NODE=$GPUS_PER_NODE; else PROCS_PER_NODE=1; fi
fi
LAUNCHER="${LAUNCHER:-torchrun}"
export GPUS_PER_NODE PROCS_PER_NODE

# ------------------------------------------------------------------ checks (nothing submitted yet)
[ -n "${CPUS_PER_TASK:-}" ] && die "CPUS_PER_TASK=$CPUS_PER_TASK is ambiguous (one torchrun task per node, or one srun" \
                                   "task per process): set CPUS_PER_NODE or CPUS_PER_PROCESS"
[ -n "${CPUS_PER_NODE:-}" ] && [ -n "${CPUS_PER_PROCESS:-}" ] && die "set CPUS_PER_NODE or CPUS_PER_PROCESS, not both"
if [ -n "${CPUS_PER_NODE:-}" ] && [ "$CPUS_PER_NODE" -lt "$PROCS_PER_NODE" ]; then
    die "CPUS_PER_NODE=$CPUS_PER_NODE is fewer than PROCS_PER_NODE=$PROCS_PER_NODE"
fi
for l in "$LAUNCHER" "${PRETRAIN_LAUNCHER:-$LAUNCHER}" "${CONTEXT_LAUNCHER:-$LAUNCHER}"; do
    case "$l" in torchrun|srun) ;; *) die "LAUNCHER must be torchrun or srun (got $l)" ;; esac
done
# shellcheck disable=SC2086
if ! compgen -G "$INPUT" >/dev/null && [ ! -e "$INPUT" ]; then die "INPUT=$INPUT matches no file"; fi
if [ -n "${TOKENIZER_MODEL:-}" ] && [ "$TOKENIZER_ON_HUB" = 0 ] && [ ! -e "$TOKENIZER_MODEL" ]; then
    die "${TOKENIZER_FROM/TOKENIZER_MODEL/TOKENIZER_MODEL=$TOKENIZER_MODEL} does not exist -- nothing submitted"
fi
export TOKENIZER_TYPE TOKENIZER_MODEL  # the jobs' (preprocess.sbatch, pretrain.sbatch, ...)
if [ "$TOKENIZER_ON_HUB" = 1 ]; then
    # downloaded here (or found in the cache) before anything is queued: the compute nodes have no internet
    if ! out=$(lol_py -c \
               'import sys; from megatron_lol.data.tokenizers import hub_tokenizer_file; print(hub_tokenizer_file(sys.argv[1]))' \
               "$TOKENIZER_MODEL" 2>&1); then
        die "TOKENIZER_MODEL=$TOKENIZER_MODEL: $(grep -v '^\s' <<<"$out" | tail -n 1) -- nothing submitted"
    fi
    echo "tokenizer: $TOKENIZER_MODEL from the Hub cache (${out##*$'\n'}); the jobs read it offline"
fi
# from here on, the checks below and every job read Hub files from the cache the step above filled, as
# compute nodes without internet must
export HF_HUB_OFFLINE=1

# stage_args STAGE: the `megatron-lol train` arguments of the pretrain / context stage
stage_args() {
    local args
    if [ "$1" = pretrain ]; then
        args=(--config "$PRETRAIN_CONFIG" --save "$WORK_DIR/pretrain")
    else
        args=(--config "$CONTEXT_CONFIG" --save "$WORK_DIR/context_ext" --load "$WORK_DIR/pretrain")
    fi
    args+=(--data-path "$DATA_PREFIX" --tokenizer-type "$TOKENIZER_TYPE")
    [ -n "${TOKENIZER_MODEL:-}" ] && args+=(--tokenizer-model "$TOKENIZER_MODEL")
    printf '%s\n' "${args[@]}"
}

if [ "${VALIDATE:-1}" = 1 ]; then
    command -v "$PY" >/dev/null 2>&1 || [ -x "$PY" ] || \
        die "cannot validate the configs: $PY not found (set MEGATRON_LOL_PYTHON, or VALIDATE=0 to skip)"
    # the array's own command, every shard's inputs and parquet columns, the tokenizer as its workers build it
    # shellcheck disable=SC2086
    if ! out=$(lol_py -m megatron_lol preprocess --dry-run --input $INPUT --json-keys text \
               --tokenizer-type "$TOKENIZER_TYPE" ${TOKENIZER_MODEL:+--tokenizer-model "$TOKENIZER_MODEL"} \
               ${VOCAB_FILE:+--vocab-file "$VOCAB_FILE"} ${MERGE_FILE:+--merge-file "$MERGE_FILE"} \
               --output-prefix "$DATA_PREFIX_BASE" --overwrite 2>&1); then
        die "preprocess stage: $(grep -v '^usage:\|^  ' <<<"$out" | tail -n 1) -- nothing submitted"
    fi
    echo "preprocess stage: ${out##*$'\n'}"
    stages=(pretrain); [ -n "$CONTEXT_CONFIG" ] && stages+=(context)
    [ "$DATA_ONLY" = 1 ] && stages=()
    for stage in ${stages[@]+"${stages[@]}"}; do
        mapfile -t a < <(stage_args "$stage")
        if [ "$stage" = pretrain ]; then extra="${PRETRAIN_ARGS:-}"; else extra="${CONTEXT_ARGS:-}"; fi
        # shellcheck disable=SC2086,SC2206
        a+=($extra)
        # the layout against the allocation first: on failure, the planner's first proposal
        mem=(); [ -n "${DEVICE_MEMORY:-}" ] && mem=(--device-memory "$DEVICE_MEMORY")
        # (other errors, e.g. a typo, are left to the dry run below, which names them in train's words)
        if ! out=$(cd "$RUN_DIR" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m megatron_lol plan-layout \
                   --check --nodes "$NODES" --gpus-per-node "$PROCS_PER_NODE" "${mem[@]}" "${a[@]}" 2>&1) &&
           grep -q '^megatron-lol plan-layout: \(first\|no\) proposal' <<<"$out"; then
            out=$(grep '^megatron-lol' <<<"$out" || true)
            echo "submit_pipeline.sh: $stage stage: ${out%%$'\n'*} -- nothing submitted" >&2
            [ "$out" = "${out#*$'\n'}" ] || echo "${out#*$'\n'}" >&2
            exit 2
        fi
        if ! out=$(cd "$RUN_DIR" && WORLD_SIZE=$((NODES * PROCS_PER_NODE)) PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
                   "$PY" -m megatron_lol train --dry-run=config "${a[@]}" 2>&1); then
            die "$stage stage: $(grep -v '^usage:\|^  ' <<<"$out" | tail -n 1) -- nothing submitted"
        fi
        echo "$stage stage: ${out##*$'\n'}"
    done
fi

# ------------------------------------------------------------------ submission
mkdir -p "$WORK_DIR/logs" "$(dirname "$DATA_PREFIX")"
common=(--parsable --chdir="$RUN_DIR")
[ -n "${PARTITION:-}" ] && common+=(--partition="$PARTITION")
[ -n "${ACCOUNT:-}" ] && common+=(--account="$ACCOUNT")
[ -n "${QOS:-}" ] && common+=(--qos="$QOS")
# shellcheck disable=SC2206
common+=(${SBATCH_EXTRA:-})
after() { echo "--dependency=afterok:$1" --kill-on-invalid-dep=yes; }

train_flags() {  # train_flags LAUNCHER TIME
    local flags=(--nodes="$NODES") cpus=""
    if [ "$1" = srun ]; then
        flags+=(--ntasks-per-node="$PROCS_PER_NODE")
        if [ -n "${CPUS_PER_PROCESS:-}" ]; then cpus=$CPUS_PER_PROCESS
        elif [ -n "${CPUS_PER_NODE:-}" ]; then cpus=$(( CPUS_PER_NODE / PROCS_PER_NODE )); fi
    else
        flags+=(--ntasks-per-node=1)
        if [ -n "${CPUS_PER_NODE:-}" ]; then cpus=$CPUS_PER_NODE
        elif [ -n "${CPUS_PER_PROCESS:-}" ]; then cpus=$(( CPUS_PER_PROCESS * PROCS_PER_NODE )); fi
    fi
    [ -n "$cpus" ] && flags+=(--cpus-per-task="$cpus")
    [ "$GPUS_PER_NODE" -gt 0 ] && flags+=(--gpus-per-node="$GPUS_PER_NODE")
    [ -n "${2:-}" ] && flags+=(--time="$2")
    echo "${flags[@]}"
}
jobid() { cut -d';' -f1; }

pre_flags=(--array=0-$((NUM_SHARDS - 1)) --cpus-per-task="$PREPROCESS_CPUS"
           --output="$WORK_DIR/logs/%x-%A_%a.out")
[ -n "${PREPROCESS_TIME:-}" ] && pre_flags+=(--time="$PREPROCESS_TIME")
PRE=$(INPUT="$INPUT" NUM_SHARDS="$NUM_SHARDS" OUTPUT_PREFIX="$DATA_PREFIX_BASE" \
      sbatch "${common[@]}" "${pre_flags[@]}" "$REPO/slurm/preprocess.sbatch" | jobid)

# shellcheck disable=SC2046
merge_flags=($(after "$PRE") --cpus-per-task=1 --output="$WORK_DIR/logs/%x-merge-%j.out")
[ -n "${PREPROCESS_TIME:-}" ] && merge_flags+=(--time="$PREPROCESS_TIME")
MERGE=$(PREPROCESS_STEP=merge NUM_SHARDS="$NUM_SHARDS" OUTPUT_PREFIX="$DATA_PREFIX_BASE" \
        sbatch "${common[@]}" "${merge_flags[@]}" "$REPO/slurm/preprocess.sbatch" | jobid)

PRETRAIN="" CONTEXT=""
[ "$DATA_ONLY" = 1 ] && CONTEXT_CONFIG=""
pl="${PRETRAIN_LAUNCHER:-$LAUNCHER}"
# shellcheck disable=SC2046
[ "$DATA_ONLY" = 1 ] || PRETRAIN=$(LAUNCHER="$pl" CONFIG="$PRETRAIN_CONFIG" SAVE_DIR="$WORK_DIR/pretrain" DATA_PREFIX="$DATA_PREFIX" \
           TRAIN_ARGS="${PRETRAIN_ARGS:-}" \
           sbatch "${common[@]}" $(train_flags "$pl" "${PRETRAIN_TIME:-}") $(after "$MERGE") \
           --output="$WORK_DIR/logs/%x-%j.out" "$REPO/slurm/pretrain.sbatch" | jobid)

if [ -n "$CONTEXT_CONFIG" ]; then
    cl="${CONTEXT_LAUNCHER:-$LAUNCHER}"
    # shellcheck disable=SC2046
    CONTEXT=$(LAUNCHER="$cl" CONFIG="$CONTEXT_CONFIG" LOAD_DIR="$WORK_DIR/pretrain" \
              SAVE_DIR="$WORK_DIR/context_ext" DATA_PREFIX="$DATA_PREFIX" TRAIN_ARGS="${CONTEXT_ARGS:-}" \
              sbatch "${common[@]}" $(train_flags "$cl" "${CONTEXT_TIME:-}") $(after "$PRETRAIN") \
              --output="$WORK_DIR/logs/%x-%j.out" "$REPO/slurm/context_extension.sbatch" | jobid)
fi

cat > "$WORK_DIR/jobs.env" <<EOT
PREPROCESS_JOB=$PRE
MERGE_JOB=$MERGE
PRETRAIN_JOB=$PRETRAIN
CONTEXT_JOB=$CONTEXT
DATA_PREFIX=$DATA_PREFIX
EOT
echo "preprocess=$PRE merge=$MERGE pretrain=${PRETRAIN:-none} context_extension=${CONTEXT:-none} (ids in $WORK_DIR/jobs.env)"
