#!/usr/bin/env bash
# Mutation testing of the mathematical modules with mutmut 3 (pip install -e ".[mutation]").
#
#   bench/mutation.sh                      # every module listed in [tool.mutmut]; resumes
#   bench/mutation.sh objectives._flow_grpo # (re)runs every mutant of one or more of them
#
# The configuration is pyproject.toml's [tool.mutmut]: which files are mutated, which test
# files run (-x, no cache, no xdist), and a fork server that has imported only third-party
# modules and the library, so every mutant starts from fresh jit caches. The first
# run records which tests reach which function (several minutes); each mutant then runs only
# those tests. Results stay in mutants/ (delete it to start over); the summary is printed by
# bench/mutation_score.py. Not part of CI: it takes hours on two cores (docs/mutation.md).
set -euo pipefail
cd "$(dirname "$0")/.."

export FLOWGRPO_EQX_MUTATION=1
names=()
for module in "$@"; do
    names+=("flowgrpo_eqx.${module}.*")
done
# Without names mutmut runs only the mutants that have no result yet.
mutmut run --max-children "${MUTATION_CHILDREN:-2}" "${names[@]}" || true
if [ "$#" -eq 0 ]; then
    set -- _advantages _process _sde objectives._flow_grpo _guided_flow objectives._nft
fi
python bench/mutation_score.py "$@"
