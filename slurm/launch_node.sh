#!/bin/bash
# One node's share of a SLURM job. slurm/train.sbatch has `srun` run this file once on every node
# (one task per node); it starts `accelerate launch` there, which starts one process per GPU.
#
#   srun --ntasks-per-node=1 bash slurm/launch_node.sh SCRIPT [SCRIPT FLAGS ...]
#
# SLURM's per-node variables are read HERE, on each node, never in the batch script: the batch
# script runs on the first node, where SLURM_NODEID is 0, and a launch line expanded there gives
# every node machine rank 0 (docs/slurm.md, "The quoting trap").
#
# Reads (SLURM sets the first four):
#   SLURM_NODEID         this node's index in the job: the machine rank
#   SLURM_NNODES         how many nodes
#   SLURM_JOB_NODELIST   the nodes, e.g. gpu[001-004]: the first one hosts the rendezvous
#   SLURM_GPUS_ON_NODE   GPUs per node (--gpus-per-node)
#   GPUS_PER_NODE        processes per node (default: SLURM_GPUS_ON_NODE, else nvidia-smi's count)
#   MASTER_ADDR          the rendezvous host (default: the first node of SLURM_JOB_NODELIST)
#   MASTER_PORT          the rendezvous port (default: 20000 + job id modulo 20000)
#   MIXED_PRECISION      no | bf16 | fp16 (default: no)
#   LAUNCH_CPU=1         processes on the CPU (gloo), GPUS_PER_NODE of them per node: CPU clusters, tests
#   LAUNCH_DRY_RUN=1     print the launch command and stop
#   PYTHON               the interpreter (default: python3, i.e. the active environment's)
set -eu -o pipefail

fail() {
    echo "error: launch_node.sh: $*" >&2
    exit 2
}

# The first host of a SLURM host list, without scontrol (containers often lack it):
# "gpu-a[007-009,012],gpu-b1" -> gpu-a007, "node1,node2" -> node1, "n[1-2]-ib" -> n1-ib.
first_host() {
    local list=$1 head=${1%%,*}
    if [[ $head != *"["* ]]; then
        echo "$head"
        return
    fi
    local prefix=${list%%"["*} inside=${list#*"["}
    local after=${inside#*"]"}
    echo "${prefix}${inside%%[],-]*}${after%%,*}"
}

[[ -n ${SLURM_NODEID:-} ]] || fail "SLURM_NODEID is not set: run this file through srun inside a SLURM job"
[[ ${SLURM_LOCALID:-0} == 0 ]] || fail "more than one task on this node: use srun --ntasks-per-node=1"
NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}
[[ -n $NNODES ]] || fail "SLURM_NNODES is not set"
NODE_RANK=$SLURM_NODEID

if [[ -z ${MASTER_ADDR:-} ]]; then
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || fail "set MASTER_ADDR or SLURM_JOB_NODELIST"
    # scontrol knows every host-list form; the fallback handles the common ones
    if command -v scontrol >/dev/null && hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null) &&
        [[ -n $hosts ]]; then
        MASTER_ADDR=${hosts%%$'\n'*}
    else
        MASTER_ADDR=$(first_host "$SLURM_JOB_NODELIST")
    fi
fi
# the same on every node of the job (and different for two jobs sharing a node)
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [[ -z $GPUS_PER_NODE ]] && command -v nvidia-smi >/dev/null; then
    GPUS_PER_NODE=$(nvidia-smi --list-gpus | wc -l)
fi
[[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] ||
    fail "no GPU count (got '${GPUS_PER_NODE}'): request GPUs with --gpus-per-node or set GPUS_PER_NODE"

[[ $# -ge 1 ]] || fail "usage: launch_node.sh SCRIPT [SCRIPT FLAGS ...]"
script_flags=("$@")
# --multi_gpu even on CPUs: `accelerate launch --cpu --num_processes N` starts ONE process; with
# --multi_gpu torchrun starts them all, and the scripts join them in one gloo group when there is no
# CUDA (docs/troubleshooting.md, "Only one process started"). The script's --cpu keeps them off GPUs.
if [[ ${LAUNCH_CPU:-0} == 1 ]]; then
    script_flags+=(--cpu)
fi

# accelerate launch rather than bare torchrun: it sets mixed precision for the script as on one
# machine, and it runs torchrun's agent in this same process, so `exec` makes the agent the task
# that SLURM watches. Static rendezvous: the machine rank is SLURM_NODEID, fixed for the job.
cmd=(
    "${PYTHON:-python3}" -m accelerate.commands.launch
    --multi_gpu
    --num_machines "$NNODES"
    --machine_rank "$NODE_RANK"
    --num_processes "$((NNODES * GPUS_PER_NODE))"
    --main_process_ip "$MASTER_ADDR"
    --main_process_port "$MASTER_PORT"
    --rdzv_backend static
    --same_network
    --mixed_precision "${MIXED_PRECISION:-no}"
    --dynamo_backend no
    "${script_flags[@]}"
)
echo "launch_node: node $NODE_RANK of $NNODES ($(hostname)), $GPUS_PER_NODE processes," \
    "rendezvous at $MASTER_ADDR:$MASTER_PORT"
if [[ ${LAUNCH_DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

# Preemption: SLURM sends SIGTERM to every process of the job step at once, this launcher and its
# workers alike. The workers checkpoint and exit 0 on it (scripts/common/training.py, TrainStream);
# torchrun's agent would instead kill them after 30 s and fail the step. So the agent ignores
# SIGTERM (it keeps SIGINT, SIGHUP, SIGQUIT) and ends, exit code 0, when its workers have saved.
# The workers inherit the ignore until their training loop installs its own handler.
trap '' TERM
export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT
exec "${cmd[@]}"
