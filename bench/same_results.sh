#!/usr/bin/env bash
# Same numbers before and after a change: runs the same jobs with two builds of caravan and
# compares, bitwise, every loss and accuracy in metrics.jsonl and every tensor of model.pt.
#
#   bash bench/same_results.sh OLD_BUILD_DIR NEW_BUILD_DIR [OUT_DIR [JOBS]]
#
# JOBS: a regular expression; only the jobs whose names match run (default: every job).
#
# e.g. build the old commit in a worktree:
#   git worktree add /tmp/old <commit> && (cd /tmp/old && cmake -S . -B build -G Ninja &&
#   cmake --build build --target caravan) && bash bench/same_results.sh /tmp/old/build build
#
# Jobs: fmnist-cnn in one process (200 steps); --workers 2 all-reduce; 2 workers + 1 server
# ps-bsp; OSP with the layer-order split; ps-asp with 1 worker (+1 server); brown-gpt with
# memory.policy = auto under a budget that makes it recompute blocks; brown-gpt with
# memory.weights = offload (both with dropout, so the RNG order is checked too; every block in
# bf16: train.precision = bf16 would time the blocks and choose differently from run to run); local SGD,
# gossip and DiLoCo on 2 workers; a pipeline of 2 stages (1f1b, 4 micro-batches), 2 pipelines
# of 2 stages (gpipe), 3 pipelines of 2 stages (a replica average over 3), gradient
# accumulation in one process; a run stopped at step 60 and
# resumed. Every process runs one thread (deterministic on any machine). Prints each job's last
# train and eval loss; exit 0 when every job matches, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: same_results.sh OLD_BUILD_DIR NEW_BUILD_DIR [OUT_DIR]}
new=${2:?usage: same_results.sh OLD_BUILD_DIR NEW_BUILD_DIR [OUT_DIR]}
out=${3:-$(mktemp -d /tmp/caravan-same-XXXXXX)}
only=${4:-.}
python=${CARAVAN_PYTHON:-.venv/bin/python}  # the project's Python, with torch (reads model.pt)
for b in "$old" "$new"; do
  [ -x "$b/caravan" ] || { echo "same_results: $b/caravan is not an executable; build it first" >&2; exit 2; }
done
mkdir -p "$out"

cnn=(--config configs/fmnist-cnn.toml --set train.threads=1 --set train.log_every=10
     --set train.eval_every=50 --set train.eval_batches=4 --set data.batch_size=32)
gpt=(--config configs/brown-gpt.toml --set train.threads=1 --set train.log_every=5
     --set train.eval_every=20 --set train.eval_batches=2 --set train.max_minutes=0
     --set model.depth=4 --set data.batch_size=8 --set data.seq_len=64 --set train.max_steps=40
     --set model.dropout=0.1 --set schedule.horizon=steps --set train.precision=bf16-all)
declare -A jobs=(
  [cnn-1]="${cnn[*]} --set train.max_steps=200"
  [cnn-allreduce-2]="${cnn[*]} --set train.max_steps=100 --workers 2"
  [cnn-ps-bsp-2+1]="${cnn[*]} --set train.max_steps=100 --workers 2 --set sync.mode=ps-bsp --set sync.servers=1"
  [cnn-osp-layer-order-2+1]="${cnn[*]} --set train.max_steps=100 --workers 2 --set sync.mode=osp --set sync.servers=1 --set sync.osp_policy=layer-order --set sync.osp_fraction=0.5"
  [cnn-ps-asp-1+1]="${cnn[*]} --set train.max_steps=100 --workers 1 --set sync.mode=ps-asp --set sync.servers=1"
  [gpt-auto-budget]="${gpt[*]} --set memory.policy=auto --set memory.budget=24MiB"
  [gpt-offload]="${gpt[*]} --set memory.weights=offload --set optim.grad_clip=0"
  [cnn-local-sgd-2]="${cnn[*]} --set train.max_steps=100 --workers 2 --set sync.mode=local-sgd"
  [cnn-gossip-2]="${cnn[*]} --set train.max_steps=100 --workers 2 --set sync.mode=gossip"
  [cnn-diloco-2]="${cnn[*]} --set train.max_steps=100 --workers 2 --set sync.mode=diloco"
  [cnn-accumulate-4]="${cnn[*]} --set train.max_steps=100 --set parallel.micro_batches=4 --set optim.grad_clip=1"
  [gpt-pipeline-2]="${gpt[*]} --workers 2 --set parallel.pipeline_stages=2 --set parallel.micro_batches=4"
  [gpt-pipeline-2x2-gpipe]="${gpt[*]} --workers 4 --set parallel.pipeline_stages=2 --set parallel.micro_batches=2 --set parallel.schedule=gpipe"
  [gpt-pipeline-2x3]="${gpt[*]} --workers 6 --set parallel.pipeline_stages=2 --set parallel.micro_batches=2 --set train.max_steps=20"
  [cnn-resume-2]="${cnn[*]} --set train.max_steps=100 --workers 2 --set checkpoint.every=20 RESUME_AT=60"
)

status=0
for name in $(printf '%s\n' "${!jobs[@]}" | sort | grep -E -- "$only"); do
  for side in old new; do
    build=$old; [ "$side" = new ] && build=$new
    dir="$out/$name-$side"
    rm -rf "$dir"
    words=${jobs[$name]}
    resumeAt=""
    if [[ $words == *" RESUME_AT="* ]]; then  # stop there with a checkpoint, then --resume
      resumeAt=${words##* RESUME_AT=}
      words=${words% RESUME_AT=*}
    fi
    # shellcheck disable=SC2086  # the job's words
    if [ -n "$resumeAt" ] &&
       ! "$build/caravan" train -q $words --stop-at-step "$resumeAt" --run-dir "$dir" >"$dir.log" 2>&1; then
      echo "same_results: $name ($side) failed before its resume; see $dir.log" >&2
      status=1
      continue 2
    fi
    # --resume reads the config from the run directory: only the launcher's --workers again.
    run=($words --run-dir "$dir")
    # shellcheck disable=SC2207  # one or two words
    [ -n "$resumeAt" ] && run=(--resume "$dir" $(grep -o -- '--workers [0-9]*' <<<"$words" || true))
    # shellcheck disable=SC2086  # the job's words
    if ! "$build/caravan" train -q "${run[@]}" >>"$dir.log" 2>&1; then
      echo "same_results: $name ($side) failed; see $dir.log" >&2
      status=1
      continue 2
    fi
  done
  printf '  %-26s ' "$name:"
  if "$python" - "$out/$name-old" "$out/$name-new" <<'EOF'
import json, sys, torch
a, b = sys.argv[1], sys.argv[2]
def numbers(run):
    rows = []
    for line in open(run + "/metrics.jsonl"):
        r = json.loads(line)
        rows.append((r["kind"], r["step"], r.get("loss"), r.get("accuracy")))
    return rows
ra, rb = numbers(a), numbers(b)
bad = [f"{x} != {y}" for x, y in zip(ra, rb) if x != y]
if len(ra) != len(rb):
    bad.append(f"{len(ra)} records != {len(rb)} records")
ma, mb = torch.load(a + "/model.pt"), torch.load(b + "/model.pt")
if sorted(ma) != sorted(mb):
    bad.append("model.pt keys differ")
else:
    bad += [f"model.pt {k} differs" for k in ma if not torch.equal(ma[k], mb[k])]
last = lambda kind: next((r[2] for r in reversed(ra) if r[0] == kind), None)
print(f"train loss {last('train')!r}, eval loss {last('eval')!r}; "
      f"{len(ra)} records ({sum(1 for r in ra if r[0] == 'eval')} evaluations), "
      f"{len(ma)} tensors: " + ("bitwise equal" if not bad else "DIFFER: " + "; ".join(bad[:5])))
sys.exit(1 if bad else 0)
EOF
  then :; else status=1; fi
done
echo "same_results: runs in $out"
exit $status
