#!/usr/bin/env bash
# `make test`: the suite in three passes, each one's wall time printed at the end.
#   parallel     every test but the two below, on TEST_WORKERS pytest-xdist workers, a module per
#                worker at a time (its module fixtures built once; xdist_group marks do nothing
#                under pytest 9: xdist 3.8 renames a node id pytest 9 no longer reads)
#   serial       real-time chains whose timing cores shared with other tests distort, one at a time
#   engine tier  real SGLang and vLLM servers (they use both cores), one at a time
# Extra arguments go to each pass. pytest exits 5 when a pass collects no test: one pass may (the
# arguments naming a single file), not every pass.
set -uo pipefail
py=${PY:-.venv/bin/python}
workers=${TEST_WORKERS:-3}
times=()
failed=0
collected=0
run_pass() {
  local name=$1; shift
  local t0=$SECONDS rc=0
  echo "== make test: $name pass"
  "$py" -m pytest -q "$@" || rc=$?
  times+=("$name $((SECONDS - t0)) s (exit $rc)")
  if [ "$rc" -ne 5 ]; then collected=1; fi
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then failed=1; fi
}
run_pass parallel -n "$workers" --dist loadfile -m "not engine and not serial" "$@"
run_pass serial -m "serial and not engine" "$@"
run_pass "engine tier" -m engine "$@"
printf 'make test: %s\n' "$(IFS=';'; echo "${times[*]}" | sed 's/;/; /g')"
if [ "$collected" -eq 0 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi
exit "$failed"
