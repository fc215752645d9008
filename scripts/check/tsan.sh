#!/usr/bin/env bash
# Data races in the CPU backend's threads: ampTrain built with clang's ThreadSanitizer, run on the three reference
# models in every precision mode at 2 and 7 threads, then the update's other paths, a resume on another thread
# count and an evaluation. Exits 1 on any ThreadSanitizer report, or if a deliberately racy probe program built
# the same way is not reported (so a TSan that saw nothing because it was not there cannot pass).
#   scripts/check/tsan.sh                 build into build-tsan, run everything (a few minutes on 2 cores)
#   BUILD_DIR=... OUT=... scripts/check/tsan.sh
# Why clang: gcc 12's TSan crashes at load time in the resolvers of target_clones functions (they run before
# its runtime is up). Why not the Criterion suites: Criterion's arena cannot be mapped under TSan ("Could not
# initialize inheritable arena"), so whole runs are the probe. docs/backend.md, "Threads", says what this covers.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build-tsan}
out=${OUT:-$build/tsan-runs}
cc=${CC_TSAN:-clang}
command -v "$cc" > /dev/null || { echo "tsan.sh: $cc not found (scripts/install-deps.sh --test installs clang)" >&2; exit 2; }

flags="-fsanitize=thread -fno-omit-frame-pointer -g"
mkdir -p "$build"
BUILD_DIR="$build" CC="$cc" scripts/build.sh -DAMP_CUDA=OFF -DAMP_MPI=OFF -DAMP_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread > "$build/tsan-build.log" 2>&1 ||
  { tail -30 "$build/tsan-build.log"; echo "tsan.sh: the build failed ($build/tsan-build.log)" >&2; exit 2; }
rm -rf "$out" && mkdir -p "$out"

# Under a large mmap_rnd_bits, TSan can refuse the address space it is given; without ASLR it is always laid out.
norand=()
setarch "$(uname -m)" -R true 2> /dev/null && norand=(setarch "$(uname -m)" -R)

# The probe: two threads write one int with no order between them. TSan must report it.
cat > "$out/probe.c" << 'EOF'
#include <pthread.h>
static int shared;
static void *writer(void *arg) { (void)arg; shared++; return 0; }
int main(void) { pthread_t t; pthread_create(&t, 0, writer, 0); shared++; pthread_join(t, 0); return 0; }
EOF
"$cc" $flags "$out/probe.c" -o "$out/probe" -lpthread
TSAN_OPTIONS="exitcode=0 log_path=$out/probe.tsan" "${norand[@]}" "$out/probe"
if ! cat "$out"/probe.tsan.* 2> /dev/null | grep -q "WARNING: ThreadSanitizer: data race"; then
  echo "tsan.sh: ThreadSanitizer did not report the probe's race: this check would see nothing" >&2
  exit 1
fi

export OPENBLAS_NUM_THREADS=1
runs=0
fails=0
# run NAME ARGS...: one ampTrain command under TSan; its reports go to $out/NAME.tsan.*
run() {
  local name=$1
  shift
  local rc=0
  TSAN_OPTIONS="halt_on_error=0 exitcode=66 log_path=$out/$name.tsan" timeout 1200 "${norand[@]}" "$build/ampTrain" "$@" \
    > "$out/$name.log" 2>&1 || rc=$?
  local n
  n=$(cat "$out/$name".tsan.* 2> /dev/null | grep -c "WARNING: ThreadSanitizer" || true)
  runs=$((runs + 1))
  printf '%-44s exit %3d  reports %s\n' "$name" "$rc" "$n"
  if [ "$rc" -ne 0 ] || [ "$n" -ne 0 ]; then
    fails=$((fails + 1))
    tail -5 "$out/$name.log"
  fi
}

# the three models as tests/test_threads.c runs them: tests/thread_models.txt, NAME STEPS CONFIG OVERRIDES...
mlp=() cnn=() gpt=()
while read -r name steps args; do
  case $name in '' | '#'*) continue ;; esac
  read -r -a words <<< "$args run.steps=$steps"
  case $name in
    mlp) mlp=("${words[@]}") ;;
    cnn) cnn=("${words[@]}") ;;
    gpt) gpt=("${words[@]}") ;;
  esac
done < tests/thread_models.txt
[ "${#mlp[@]}" -gt 0 ] && [ "${#cnn[@]}" -gt 0 ] && [ "${#gpt[@]}" -gt 0 ] ||
  { echo "tsan.sh: tests/thread_models.txt lacks mlp, cnn or gpt" >&2; exit 1; }

for mode in fp32 fp16-dynamic bf16 fp8; do
  all=() # fp8: every product in fp8, however small (precision.fp8.min_size)
  [ "$mode" = fp8 ] && all=('precision.fp8.min_size=[0,0]')
  for t in 2 7; do
    run "mlp-$mode-t$t" run "${mlp[@]}" precision.mode=$mode "${all[@]}" run.threads=$t run.out_dir="$out/mlp-$mode-t$t"
    run "cnn-$mode-t$t" run "${cnn[@]}" precision.mode=$mode "${all[@]}" run.threads=$t run.out_dir="$out/cnn-$mode-t$t"
    run "gpt-$mode-t$t" run "${gpt[@]}" precision.mode=$mode "${all[@]}" run.threads=$t run.out_dir="$out/gpt-$mode-t$t"
  done
done
# The update's other paths: bf16 master weights and moments with stochastic rounding, accumulation with clipping,
# SGD with momentum, the numerics shadow, fp16 with a static scale.
run mlp-bf16-master-sround-t3 run "${mlp[@]}" precision.mode=bf16 precision.master_weights=bf16 optim.state_dtype=bf16 \
  optim.stochastic_rounding=true run.threads=3 run.out_dir="$out/mlp-bf16-master-sround-t3"
run cnn-accum-clip-t2 run "${cnn[@]}" precision.mode=bf16 accum_steps=2 clip.max_norm=1.0 run.threads=2 \
  run.out_dir="$out/cnn-accum-clip-t2"
run mlp-sgd-t2 run "${mlp[@]}" optim.kind=sgd optim.momentum=0.9 optim.weight_decay=0 precision.mode=fp16-static \
  run.threads=2 run.out_dir="$out/mlp-sgd-t2"
run gpt-numerics-t2 run "${gpt[@]}" precision.mode=bf16 run.numerics_every=1 run.threads=2 run.out_dir="$out/gpt-numerics-t2"
# A checkpoint of a 2-thread run resumed at 3 threads (run.threads is not in the checkpoint), and evaluated.
run mlp-half-t2 run "${mlp[@]}" precision.mode=bf16 run.steps=2 run.threads=2 run.out_dir="$out/mlp-resume"
run mlp-resume-t3 resume "$out/mlp-resume/ckpt-2.h5" run.steps=4 run.threads=3
run mlp-eval-t2 eval "$out/mlp-resume/ckpt-4.h5" --autocast on

echo "tsan.sh: $runs runs under ThreadSanitizer, $fails with a report or a failure (logs in $out)"
[ "$fails" -eq 0 ]
