#!/usr/bin/env bash
# A GPU session's device work, prepared so that one call of the lent machine does it.
#
# A task is lent a GPU machine by chance (see docs/performance.md "GPU figures"), for ~15 minutes of device
# time in all, machine start included, at most 10 minutes a command. That machine is bare: its
# image has torch, triton, transformers, einops and pytest, but not hydra-core / omegaconf, and
# nothing can be fetched there. So:
#
#   bench/gpu_session.sh fetch          # HERE, with network: pure-Python wheels -> .whl/ (git-ignored)
#   bash bench/gpu_session.sh run       # THERE, via the device tool, carry [".whl"]: installs
#                                       # the wheels and meshtron into /tmp/site, then runs the
#                                       # steps below, each one's output in $OUT as it finishes
#   bash bench/gpu_session.sh kernels   # THERE, the same way: issue 36's kernel measurements
#                                       # (see "kernels" below), one results file
#   bash bench/gpu_session.sh peers     # THERE, the same way: issue 37's meshtron beside
#                                       # torchtitan and Megatron-Core (see "peers" below)
#   bash bench/gpu_session.sh checks    # THERE, the same way: issue 37's CUDA-only paths as
#                                       # tests, and the packed-document attention figures
#   bash bench/gpu_session.sh rehearse  # THERE, the same way: issue 38's ranks of big layouts
#                                       # rehearsed on one GPU beside the planner (see "rehearse")
#   bash bench/gpu_session.sh moe_experts  # THERE, the same way: issue 40's many small experts
#                                       # beside 8 large ones, one MoE layer (see "moe_experts")
#
# Steps, most wanted first (issue 12's open target is the MoE block against Mixtral on a GPU),
# each under `timeout` so that a slow one cannot take the rest's time; the whole run keeps to
# GPU_SESSION_BUDGET seconds (default 500, inside the tool's 600-second command limit):
#   env           nvidia-smi, torch / triton / transformers versions         -> $OUT/env.txt
#   moe_bf16      bench/moe_layer.py --device cuda --dtype bf16 --kernels auto --peer --rounds 3
#   moe_large     the same at Mixtral-8x7B's width (h 4096, ffn 14336, 4,096 tokens), where the
#                 GEMMs, not the host's op dispatch, set the time    -> $OUT/moe_layer_large_bf16.json
#   moe_compile   five JSON lines: moe_bf16 with both blocks under torch.compile(mode=
#                 "reduce-overhead": fused kernels replayed as CUDA graphs, so host dispatch no
#                 longer sets the time), then bench/throughput.py on a small MoE model in bf16
#                 eager and with --compile-moe (trainer.compile_moe: each layer one graph), then
#                 the same with a capacity (1.25) eager and with --compile-moe, which compiles
#                 the router and experts only (the mode every layout with ep > 1 gets; one GPU
#                 cannot run ep > 1)                                 -> $OUT/moe_layer_compile_bf16.json
#   moe_swiglu_ab four JSON lines: the moe_compile step's small MoE model eager in bf16 with
#                 auto as it is, then with the experts' fused SwiGLU always on
#                 (--swiglu-min-elements 0), twice, alternating   -> $OUT/moe_swiglu_ab.json
#   compile_blocks  that model with every block compiled (--compile), then on CUDA with CUDA
#                 graphs too (--compile-mode reduce-overhead)     -> $OUT/compile_blocks.json
#   moe_fp32      the issue's shape in fp32                                    -> $OUT/moe_layer_*.json
#   acceptance    bench/gpu_acceptance.py --sections kernels,steps,card       -> $OUT/acceptance.json
#   bench         bench/gpu_acceptance.py --sections bench (kernels, throughput, MoE again)
#                                                                              -> $OUT/acceptance_bench.json
# $OUT/log.txt has every step's stderr and its exit status; `run` exits 1 when a step failed
# (a skipped one is not a failure). GPU_SESSION_STEPS picks steps (comma list, in the order
# above), GPU_SESSION_MOE_ARGS adds moe_layer.py options to both MoE steps, GPU_SESSION_SITE
# is the install folder (default /tmp/site). Without CUDA (`run` here) every step still runs
# on the CPU at a tiny size, to prove the script before a device minute is spent on it:
#   OUT=/tmp/out bash bench/gpu_session.sh run
#
# kernels: issue 36's measurements within GPU_SESSION_BUDGET seconds (default 470: under 8
# minutes with the install), each part under `timeout` with its own cap, most wanted first:
#   gpt_1b_tp4   bench/kernel_speed.py --shapes gpt_1b_tp4 (norms, cross-entropy, linear+act, GEMMs, grouped)
#   8b           bench/kernel_speed.py --shapes 8b (the same at 8,192 tokens / h 4096, the LM head + loss)
#   e2e_llama    bench/kernel_speed.py --e2e llama_8l_h1024 (bench/throughput.py, kernels torch vs auto)
#   e2e_gpt_1b   bench/kernel_speed.py --e2e gpt_1b_4l
#   e2e_fp8      bench/kernel_speed.py --e2e fp8_loss (bench/throughput.py, trainer.precision bf16 vs fp8, 200 steps)
# then bench/kernel_records.py merge, which always runs: every target of the issue gets a record
# (a part that ran out of time leaves its targets "not measured"), in
#   $OUT/results/gpu/<UTC date>-<device>-kernels.json  -> copy into bench/results/gpu/ and commit
# ($OUT/results/gpu, not $OUT/bench/results/gpu: the device tool returns files at most two
# folders below $OUT). Each part's records are in $OUT/parts/ until the merge; $OUT/log.txt has
# every part's stderr (a table of its records) and exit status; `kernels` exits 1 when a part
# failed. GPU_SESSION_PARTS picks parts. Without CUDA the same parts run on the CPU at tiny sizes
# with TRITON_INTERPRET=1 (every code path once, the Triton calls included; nothing measured):
#   OUT=/tmp/out bash bench/gpu_session.sh kernels
#
# peers: issue 37's comparison within GPU_SESSION_BUDGET seconds (default 470), bench/peers.py
# once per model, each under `timeout` with its own cap (the kernels part's rule: a part may use
# the slack, never the caps of the parts after it), most wanted first:
#   dense_1b  dense_3b  moe_fine  moe_mixtral   (shapes and what each side runs: bench/peers.py)
# Each part leaves its raw figures in $OUT/parts/<model>.json as it goes (a part cut off keeps
# what it measured); then `bench/peers.py --merge-only` always runs: one record per target, the
# unmeasured ones "not measured", in $OUT/results/gpu/<UTC date>-<device>-peers.json. The peer
# packages are the Python 3.12 wheels that `fetch` puts in .whl/peers/ (torchtitan and
# Megatron-Core and what their imported modules need), installed beside meshtron into
# GPU_SESSION_SITE. Without CUDA every part runs bench/peers.py's CPU rehearsal (tiny shapes,
# fp32, eager), with the peers that import here (.peers-cpu/, see docs/performance.md).
# GPU_SESSION_PARTS picks parts, GPU_SESSION_PEERS_ARGS adds bench/peers.py options:
#   OUT=/tmp/out bash bench/gpu_session.sh peers
#
# checks: issue 37's device-only code paths within GPU_SESSION_BUDGET seconds (default 240):
# `pytest -m cuda` on CHECK_TESTS (the ring's flash chunk pairs, varlen / flex packed-document
# attention, FP8 expert GEMMs by _scaled_grouped_mm, compiled blocks with and without CUDA
# graphs) -> $OUT/pytest_cuda.txt, then bench/attention_check.py (varlen and flex beside the
# dense mask: error, memory, time at s 4096 / 8192) -> $OUT/attention_check.json.
#   OUT=/tmp/out bash bench/gpu_session.sh checks
#
# rehearse: issue 38's rehearsals within GPU_SESSION_BUDGET seconds (default 420), one process
# (bench/rehearse_gpu.py), which starts a part only while its budget (the verb's, less the install
# and a 10-second margin) has room for the longest part so far: the card command
# `+model=gpt_1b parallel.tp=4 parallel.ep=8` at ranks 0 and 7, the planner's top layout for 64
# H100s one rank per pipeline stage, then the card's ranks 1-6 (its busiest expert rank is the
# busiest of those that ran). It rewrites its records after every part, so a part cut off by the
# outer `timeout` leaves the others' figures and says so:
#   $OUT/results/gpu/<UTC date>-<device>-rehearse.json   -> copy into bench/results/gpu/ and commit
#   $OUT/rehearse/card_rank0.json, card_rank<busiest>.json, plan_stage<first/last>.json, summary.json
# (the full `meshtron.rehearse --json` reports; summary.json has every rehearsal's key figures).
# env_info goes into $OUT/log.txt (the device tool returns at most 8 files). Without CUDA it runs
# bench/rehearse_gpu.py's CPU rehearsal (tiny shapes, fp32; under a minute).
# GPU_SESSION_REHEARSE_ARGS adds bench/rehearse_gpu.py options (e.g. "--card-ranks 0,7"):
#   OUT=/tmp/out bash bench/gpu_session.sh rehearse
#
# moe_experts: issue 40's sweep within GPU_SESSION_BUDGET seconds (default 150: ~60 s measuring
# plus the install): bench/moe_many_experts.py, one MoE layer forward + backward in bf16 with
# kernels.backend=auto at hidden 2048, 8,192 tokens: 8 experts of 3072 top-2 beside 64 / 128 / 256
# experts of 768 top-8 (Qwen3-30B-A3B's experts; equal active FLOPs per token): per-token time,
# host ops per layer, nested ops, grouped-GEMM share (kernel time) ->
#   $OUT/results/gpu/<UTC date>-<device>-moe-experts.json   -> copy into bench/results/gpu/ and commit
# Without CUDA it runs the script's --cpu-rehearsal (tiny sizes, fp32; seconds).
# GPU_SESSION_MOE_EXPERTS_ARGS adds bench/moe_many_experts.py options (e.g. "--rounds 5"):
#   OUT=/tmp/out bash bench/gpu_session.sh moe_experts
set -uo pipefail
cd "$(dirname "$0")/.."

CHECK_TESTS=(tests/test_context_parallel_blocks.py tests/test_document_attention.py tests/test_fp8.py
             tests/test_compile_blocks.py)

WHEELS=.whl
# What meshtron imports that the device image lacks (its package list: .library/device/KINDS.md),
# at the versions CI installs (so the device runs what the suite tested), and Liger-Kernel, issue
# 36's peer for the fused LM head + loss (pure Python + Triton; `pip wheel --no-deps liger-kernel`
# fetched 0.8.5 here on 2026-11-27; it needs only torch and triton, which the image has).
FETCH=("hydra-core==1.3.8" "omegaconf==2.3.1" "antlr4-python3-runtime==4.9.3" "liger-kernel==0.8.5")
# Issue 37's peers, for the device's Python 3.12, in .whl/peers/ (a folder of their own: the
# cp312 Megatron-Core wheel does not install on another Python, so `install` leaves them out).
# torchtitan's Requires-Dist lists datasets, tokenizers, torchdata, wandb, tensorboard ...;
# the modules bench/peers.py imports (its model classes, config builders, loss, compile) import
# only spmd_types and tyro (with typeguard, docstring-parser) beyond the image's packages
# (checked 2026-11-28 by importing them with only these installed). Megatron-Core needs numpy and
# packaging, which the image has. 0.19.2 is the newest Megatron-Core on PyPI on 2026-11-28.
PEER_FETCH=("torchtitan==0.3.0" "spmd-types==0.2.3" "tyro==1.0.17" "typeguard==4.6.1" "docstring-parser==0.18.0"
            "megatron-core==0.19.2")
PEER_PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
                --platform manylinux2014_x86_64)

fetch() {
    mkdir -p "$WHEELS"
    # pure-Python packages: `pip wheel` also builds antlr4's (sdist-only on PyPI) into a py3 wheel
    python3 -m pip wheel --quiet --no-deps -w "$WHEELS" "${FETCH[@]}" || return 1
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PEER_PLATFORMS[@]}" -d "$WHEELS/peers" "${PEER_FETCH[@]}" || return 1
    ls -l "$WHEELS" "$WHEELS/peers"
}

install() {  # install LOG: the wheels and meshtron into GPU_SESSION_SITE, on PYTHONPATH after
    local log=$1 site="${GPU_SESSION_SITE:-/tmp/site}" wheels=() had_build=0
    shopt -s nullglob; wheels=("$WHEELS"/*.whl); shopt -u nullglob  # none: this python has them already
    [ -e build ] && had_build=1
    python3 -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target "$site" "${wheels[@]}" . >>"$log" 2>&1 || { echo "install failed (see log.txt)" | tee -a "$log"; return 1; }
    [ "$had_build" = 1 ] || rm -rf build  # setuptools' in-tree build folder
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
}

part_limit() {  # part_limit I: seconds part I of the caller's names / caps may take, or "unwanted"
    # (not in its parts): the budget left less the caps of the wanted parts after it, at least its
    # own cap, at most what is left. Reads the caller's names, caps, parts, budget and start.
    local i=$1 j later=0 left limit
    case ",$parts," in *",${names[$i]},"*) ;; *) echo unwanted; return ;; esac
    for ((j = i + 1; j < ${#names[@]}; j++)); do
        case ",$parts," in *",${names[$j]},"*) later=$((later + caps[j])) ;; esac
    done
    left=$((budget - (SECONDS - start)))
    limit=$((left - later))
    [ "$limit" -lt "${caps[$i]}" ] && limit=${caps[$i]}
    [ "$limit" -gt "$left" ] && limit=$left
    echo "$limit"
}

env_info() {
    nvidia-smi -L 2>&1 || true
    python3 - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "einops", "hydra", "meshtron"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:  # a missing package is what this step is for
        print(name, "MISSING", exc)
EOF
    date -u
}

run() {
    local out="${OUT:?set OUT to the folder that receives the results}"
    local budget="${GPU_SESSION_BUDGET:-500}" steps="${GPU_SESSION_STEPS:-env,moe_bf16,moe_large,moe_compile,moe_swiglu_ab,compile_blocks,moe_fp32,acceptance,bench}"
    local start=$SECONDS log="$out/log.txt" failed=""
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    install "$log" || return 1

    local cuda
    cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$log")
    local device=cuda moe_size=() rounds=3 large=(--tokens 4096 --hidden 4096 --ffn 14336)
    local train=(--arch llama --layers 4 --hidden 1024 --heads 16 --kv-heads 8 --ffn 2816 --vocab 32000 --seq 1024
                 --batch 8 --experts 8 --top-k 2 --moe-ffn 1408 --warmup 3 --steps 10)
    read -r -a moe_extra <<<"${GPU_SESSION_MOE_ARGS:-}"  # more moe_layer.py options, e.g. "--tokens 4096"
    if [ "$cuda" != "1" ]; then  # rehearsal on a CPU host: same steps, tiny shapes
        device=cpu moe_size=(--tokens 128 --iters 2 --warmup 1) rounds=1 large=(--hidden 64 --ffn 128)
        train=(--arch llama --layers 1 --hidden 32 --heads 2 --vocab 128 --seq 8 --batch 2 --experts 4 --top-k 2
               --moe-ffn 32 --warmup 1 --steps 1)
        echo "no CUDA: rehearsal on the CPU at a tiny size" | tee -a "$log"
    fi

    step() {  # step NAME OUTFILE CMD...: run CMD if NAME is wanted and time is left
        local name=$1 file=$2; shift 2
        case ",$steps," in *",$name,"*) ;; *) return 0 ;; esac
        local left=$((budget - (SECONDS - start)))
        if [ "$left" -lt 20 ]; then echo "== $name: skipped, ${left}s of the budget left" | tee -a "$log"; return 0; fi
        echo "== $name (up to ${left}s): $*" | tee -a "$log"
        local t0=$SECONDS
        timeout --kill-after=5 "$left" "$@" >"$out/$file" 2>>"$log"
        local rc=$?
        [ "$rc" = 0 ] || failed="$failed $name"
        echo "== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
        tail -c 600 "$out/$file"; echo
    }

    export -f env_info
    step env env.txt bash -c env_info
    moe() {  # moe STEP FILE DTYPE [OPTIONS...]: the MoE block beside Mixtral's
        local name=$1 file=$2 dtype=$3; shift 3
        step "$name" "$file" python3 bench/moe_layer.py --device "$device" --dtype "$dtype" --kernels auto --peer \
            --rounds "$rounds" "${moe_size[@]}" "$@" "${moe_extra[@]}"
    }
    moe moe_bf16 moe_layer_bf16.json bf16
    moe moe_large moe_layer_large_bf16.json bf16 "${large[@]}"
    # The block compiled, then a small MoE model's training step eager and compiled, then the
    # same with a capacity (compile_moe's router-and-experts mode): one shell line (timeout runs
    # commands, not functions), each part's JSON on its own line.
    local throughput=(python3 bench/throughput.py "${train[@]}" --device "$device" --precision bf16 --kernels auto)
    step moe_compile moe_layer_compile_bf16.json bash -c "$(printf '%q ' python3 bench/moe_layer.py \
        --device "$device" --dtype bf16 --kernels auto --peer --rounds "$rounds" "${moe_size[@]}" "${moe_extra[@]}" \
        --compile reduce-overhead) && $(printf '%q ' "${throughput[@]}") && $(printf '%q ' "${throughput[@]}" --compile-moe) \
        && $(printf '%q ' "${throughput[@]}" --capacity-factor 1.25) \
        && $(printf '%q ' "${throughput[@]}" --capacity-factor 1.25 --compile-moe)"
    # Issue 37's A/B of the host-bound bf16 MoE step (10-22% slower with the permutation gathers
    # and the fused SwiGLU both on): auto as it is (the SwiGLU only from 2^26 elements) against
    # the SwiGLU always on, alternating, two rounds: what the SwiGLU alone costs or saves.
    local ab_line="" ab_round
    for ab_round in 1 2; do
        ab_line+="${ab_line:+ && }$(printf '%q ' "${throughput[@]}") && $(printf '%q ' "${throughput[@]}" --swiglu-min-elements 0)"
    done
    step moe_swiglu_ab moe_swiglu_ab.json bash -c "$ab_line"
    # The same small MoE model with every block compiled (trainer.compile), then with CUDA graphs
    # too (reduce-overhead: dropless ep = 1 has no host sync; CUDA only, the CPU refuses it).
    local blocks_line
    blocks_line="$(printf '%q ' "${throughput[@]}" --compile)"
    [ "$device" = cuda ] && blocks_line+=" && $(printf '%q ' "${throughput[@]}" --compile --compile-mode reduce-overhead)"
    step compile_blocks compile_blocks.json bash -c "$blocks_line"
    moe moe_fp32 moe_layer_fp32.json fp32
    # Without CUDA gpu_acceptance prints why it skips: the rehearsal proves it starts.
    step acceptance acceptance.json python3 bench/gpu_acceptance.py --sections kernels,steps,card
    [ "$device" = cuda ] && step bench acceptance_bench.json python3 bench/gpu_acceptance.py --sections bench
    echo "total $((SECONDS - start))s of ${budget}s${failed:+; failed:$failed}" | tee -a "$log"
    [ -z "$failed" ]
}

kernels() {
    local out="${OUT:?set OUT to the folder that receives the results}"
    local budget="${GPU_SESSION_BUDGET:-470}" parts="${GPU_SESSION_PARTS:-gpt_1b_tp4,8b,e2e_llama,e2e_gpt_1b,e2e_fp8}"
    local start=$SECONDS log="$out/log.txt" failed="" partdir="$out/parts" results="$out/results/gpu"
    mkdir -p "$out" "$partdir"
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    install "$log" || return 1

    local cuda device=cuda
    cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$log")
    if [ "$cuda" != "1" ]; then
        device=cpu
        export TRITON_INTERPRET=1
        echo "no CUDA: rehearsal on the CPU at tiny sizes, Triton in its interpreter" | tee -a "$log"
    fi
    env_info >"$out/env.txt" 2>>"$log"

    # Each part reserves CAP seconds of the budget, in this order; a part may use the budget's
    # slack beyond its own CAP, never the reservations of the parts after it.
    local names=(gpt_1b_tp4 8b e2e_llama e2e_gpt_1b e2e_fp8) caps=(150 125 75 80 40)
    local args_gpt_1b_tp4=(--shapes gpt_1b_tp4 --not-built) args_8b=(--shapes 8b)
    local args_e2e_llama=(--e2e llama_8l_h1024) args_e2e_gpt_1b=(--e2e gpt_1b_4l) args_e2e_fp8=(--e2e fp8_loss)
    local i name limit rc
    for i in "${!names[@]}"; do
        name=${names[$i]}
        limit=$(part_limit "$i")
        [ "$limit" = unwanted ] && continue
        if [ "$limit" -lt 20 ]; then echo "== $name: skipped, $((budget - (SECONDS - start)))s of the budget left" | tee -a "$log"; continue; fi
        local -n args="args_$name"
        local extra=()
        [ "${args[0]}" = --e2e ] && extra=(--e2e-timeout $((limit - 10)))
        echo "== $name (up to ${limit}s): bench/kernel_speed.py ${args[*]}" | tee -a "$log"
        local t0=$SECONDS
        timeout --kill-after=5 "$limit" python3 bench/kernel_speed.py --device "$device" --out "$partdir/$name.json" \
            "${args[@]}" "${extra[@]}" >/dev/null 2>>"$log"
        rc=$?
        unset -n args
        [ "$rc" = 0 ] || failed="$failed $name"
        echo "== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
    done
    # Always: every target gets a record, the unmeasured ones saying why.
    shopt -s nullglob
    local files=("$partdir"/*.json)
    shopt -u nullglob
    echo "== merge: ${#files[@]} part files" | tee -a "$log"
    if python3 bench/kernel_records.py merge --dir "$results" "${files[@]}" 2>&1 | tee -a "$log"; then
        rm -rf "$partdir"  # the merged file holds every record (the device tool returns at most 8 files)
    else
        failed="$failed merge"
    fi
    echo "total $((SECONDS - start))s of ${budget}s${failed:+; failed:$failed}" | tee -a "$log"
    [ -z "$failed" ]
}

peers() {
    local out="${OUT:?set OUT to the folder that receives the results}"
    local budget="${GPU_SESSION_BUDGET:-470}" parts="${GPU_SESSION_PARTS:-dense_1b,dense_3b,moe_fine,moe_mixtral}"
    local start=$SECONDS log="$out/log.txt" failed="" partdir="$out/parts" results="$out/results/gpu"
    local site="${GPU_SESSION_SITE:-/tmp/site}"
    mkdir -p "$out" "$partdir"
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    install "$log" || return 1
    local peer_wheels=()
    shopt -s nullglob; peer_wheels=("$WHEELS"/peers/*.whl); shopt -u nullglob
    if [ "$(python3 -c 'import sys; print(sys.version_info[:2] == (3, 12))')" = True ] && [ ${#peer_wheels[@]} -gt 0 ]; then
        python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$site" \
            "${peer_wheels[@]}" >>"$log" 2>&1 || echo "peer wheels did not install (see log.txt)" | tee -a "$log"
    else
        echo "peer wheels (.whl/peers, Python 3.12) not installed here: bench/peers.py takes the peers it can import" \
            | tee -a "$log"
    fi

    local cuda extra=() more=()
    read -r -a more <<<"${GPU_SESSION_PEERS_ARGS:-}"  # more bench/peers.py options, e.g. "--sides meshtron torchtitan"
    cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$log")
    if [ "$cuda" != "1" ]; then
        extra=(--cpu-rehearsal)
        echo "no CUDA: bench/peers.py's CPU rehearsal (tiny shapes, fp32, eager)" | tee -a "$log"
    fi
    env_info >"$out/env.txt" 2>>"$log"

    # Each part reserves CAP seconds of the budget, in this order (as in `kernels`).
    local names=(dense_1b dense_3b moe_fine moe_mixtral) caps=(120 130 110 100)
    local i name limit rc t0
    for i in "${!names[@]}"; do
        name=${names[$i]}
        limit=$(part_limit "$i")
        [ "$limit" = unwanted ] && continue
        if [ "$limit" -lt 20 ]; then echo "== $name: skipped, $((budget - (SECONDS - start)))s of the budget left" | tee -a "$log"; continue; fi
        echo "== $name (up to ${limit}s): bench/peers.py --models $name ${extra[*]}" | tee -a "$log"
        t0=$SECONDS
        timeout --kill-after=5 "$limit" python3 bench/peers.py --models "$name" --raw-dir "$partdir" --no-records \
            "${extra[@]}" "${more[@]}" >/dev/null 2>>"$log"
        rc=$?
        [ "$rc" = 0 ] || failed="$failed $name"
        echo "== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
    done
    # Always: every target gets a record, the unmeasured ones saying why.
    echo "== merge" | tee -a "$log"
    if python3 bench/peers.py --merge-only --raw-dir "$partdir" --out-dir "$results" "${extra[@]}" 2>&1 | tee -a "$log"; then
        # the raw figures (every step time, loss, build time) in one file: the device tool returns at most 8
        python3 -c 'import json, sys; print(json.dumps({p.split("/")[-1][:-5]: json.load(open(p)) for p in sys.argv[1:]}))' \
            "$partdir"/*.json >"$out/peers_raw.json" 2>>"$log" && rm -rf "$partdir"
    else
        failed="$failed merge"
    fi
    echo "total $((SECONDS - start))s of ${budget}s${failed:+; failed:$failed}" | tee -a "$log"
    [ -z "$failed" ]
}

checks() {
    local out="${OUT:?set OUT to the folder that receives the results}"
    local budget="${GPU_SESSION_BUDGET:-240}" start=$SECONDS log="$out/log.txt" failed="" left rc
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    install "$log" || return 1
    env_info >"$out/env.txt" 2>>"$log"
    local cuda rehearsal=()
    cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$log")
    [ "$cuda" = 1 ] || { rehearsal=(--cpu-rehearsal); echo "no CUDA: the cuda tests skip, attention_check rehearses" | tee -a "$log"; }
    # The device paths no CPU can run, as pass / fail tests (half the budget at most).
    echo "== pytest -m cuda: ${CHECK_TESTS[*]}" | tee -a "$log"
    timeout --kill-after=5 $((budget / 2)) python3 -m pytest -q -p no:cacheprovider -m cuda "${CHECK_TESTS[@]}" \
        >"$out/pytest_cuda.txt" 2>&1
    rc=$?
    [ "$rc" = 0 ] || failed="$failed pytest"
    echo "== pytest: exit $rc after $((SECONDS - start))s; $(tail -n 1 "$out/pytest_cuda.txt")" | tee -a "$log"
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 20 ]; then
        echo "== attention_check: skipped, ${left}s left" | tee -a "$log"
    else
        timeout --kill-after=5 "$left" python3 bench/attention_check.py "${rehearsal[@]}" --out "$out/attention_check.json" \
            >/dev/null 2>>"$log" || failed="$failed attention_check"
        echo "== attention_check: after $((SECONDS - start))s" | tee -a "$log"
    fi
    echo "total $((SECONDS - start))s of ${budget}s${failed:+; failed:$failed}" | tee -a "$log"
    [ -z "$failed" ]
}

rehearse() {
    local out="${OUT:?set OUT to the folder that receives the results}"
    local budget="${GPU_SESSION_BUDGET:-420}" start=$SECONDS log="$out/log.txt" failed="" results="$out/results/gpu"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    install "$log" || return 1
    local cuda extra=() more=() left rc
    read -r -a more <<<"${GPU_SESSION_REHEARSE_ARGS:-}"  # more bench/rehearse_gpu.py options
    cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$log")
    if [ "$cuda" != "1" ]; then
        extra=(--cpu-rehearsal)
        echo "no CUDA: bench/rehearse_gpu.py's CPU rehearsal (tiny shapes, fp32)" | tee -a "$log"
    fi
    env_info >>"$log" 2>&1  # in the log, not env.txt: the device tool returns at most 8 files
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
        echo "== rehearse: skipped, ${left}s of the budget left" | tee -a "$log"
        return 1
    fi
    echo "== rehearse (up to ${left}s): bench/rehearse_gpu.py --budget $((left - 10)) ${extra[*]} ${more[*]}" | tee -a "$log"
    timeout --kill-after=5 "$left" python3 bench/rehearse_gpu.py --budget $((left - 10)) --out-dir "$results" \
        --reports-dir "$out/rehearse" "${extra[@]}" "${more[@]}" >>"$log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || failed="$failed rehearse"
    grep -E '^(rehearsed rank|memory:|time:|job:|== (card|top|plan)|[0-9]+ records)' "$log" | tail -n 40
    echo "== rehearse: exit $rc after $((SECONDS - start))s" | tee -a "$log"
    # the records as they stand (a cut-off part says so in its records), checked against the targets
    shopt -s nullglob
    local files=("$results"/*-rehearse.json)
    shopt -u nullglob
    if [ ${#files[@]} -eq 0 ]; then
        echo "== check: no records file" | tee -a "$log"
        failed="$failed records"
    elif ! python3 bench/rehearse_gpu.py --check "${files[@]}" 2>&1 | tee -a "$log"; then
        failed="$failed check"
    else
        echo "== check: ${files[*]} passes" | tee -a "$log"
    fi
    echo "total $((SECONDS - start))s of ${budget}s${failed:+; failed:$failed}" | tee -a "$log"
    [ -z "$failed" ]
}

moe_experts() {
    local out="${OUT:?set OUT to the folder that receives the results}"
    local budget="${GPU_SESSION_BUDGET:-150}" start=$SECONDS log="$out/log.txt" results="$out/results/gpu" left rc
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    unset TRITON_INTERPRET
    install "$log" || return 1
    local cuda extra=() more=()
    read -r -a more <<<"${GPU_SESSION_MOE_EXPERTS_ARGS:-}"  # more bench/moe_many_experts.py options
    cuda=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>>"$log")
    if [ "$cuda" = "1" ]; then
        extra=(--device cuda --dtype bf16 --kernels auto)
    else
        extra=(--cpu-rehearsal)
        echo "no CUDA: bench/moe_many_experts.py's CPU rehearsal (tiny sizes, fp32)" | tee -a "$log"
    fi
    env_info >>"$log" 2>&1  # in the log: the device tool returns at most 8 files
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
        echo "== moe_experts: skipped, ${left}s of the budget left" | tee -a "$log"
        return 1
    fi
    echo "== moe_experts (up to ${left}s): bench/moe_many_experts.py ${extra[*]} ${more[*]}" | tee -a "$log"
    timeout --kill-after=5 "$left" python3 bench/moe_many_experts.py "${extra[@]}" --out-dir "$results" "${more[@]}" \
        2>&1 | grep -v '^USDT' | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "== moe_experts: exit $rc after $((SECONDS - start))s" | tee -a "$log"
    [ "$rc" = 0 ]
}

case "${1:-}" in
    fetch) fetch ;;
    run) run ;;
    kernels) kernels ;;
    peers) peers ;;
    checks) checks ;;
    rehearse) rehearse ;;
    moe_experts) moe_experts ;;
    *) echo "usage: bench/gpu_session.sh fetch|run|kernels|peers|checks|rehearse|moe_experts   (see the comment at the top)" >&2; exit 2 ;;
esac
