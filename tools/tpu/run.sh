#!/usr/bin/env bash
# The project on a bare TPU machine that reaches no package registry (docs/accelerators.md).
#
#   bash tools/tpu/run.sh wheels           # here, with pip and the internet: the wheels the
#                                          # TPU machine's own index lacks, into .whl-tpu/
#   bash tools/tpu/run.sh test [ARGS...]   # there: install, then the suite (pytest ARGS)
#   bash tools/tpu/run.sh python ARGS...   # there: install, then `python3 ARGS` (a bench, a job)
#   bash tools/tpu/run.sh await            # there: wait (up to 120 s) for the process an
#                                          # earlier command left holding the chip
#   bash tools/tpu/run.sh suite [FOLDER...] [-- PYTEST_ARGS...]
#                                          # there: the tests that the records in FOLDER...
#                                          # have not finished (of PYTEST_ARGS's selection, as
#                                          # `@FILE` of test ids), until FLOWGRPO_TPU_BUDGET
#                                          # seconds (570) after the command began
#
# `suite` writes its record (record-TIME.jsonl: each test's outcome as it ends) and its log
# (suite-TIME.log) into $OUT (or suite-records/), and resumes from the records of the earlier
# commands carried in FOLDER... (tests/suite_record.py); `python -m tools.tpu.tally FOLDER...`
# then counts what all of them finished.
#
# There, the machine's own JAX, jaxlib and libtpu stay first on the path: what pip installs
# goes to a folder at the end of PYTHONPATH, from the machine's index (file:///opt/pypi/simple)
# and the carried wheels. One process at a time holds the chip, so the suite runs in one
# process (no -n). Set FLOWGRPO_TPU_SITE to install somewhere else than /tmp/flowgrpo-site (a
# new or empty folder, which the script then owns), and FLOWGRPO_TPU_TIMEOUT=SECONDS to
# interrupt the suite SECONDS after `test` began, the install included (as Ctrl-C would: it
# still prints its summary; killed 15 s later if it has not ended), before a limit of the
# machine's. What the install says goes to stderr, so a `python` command's stdout is its own (a
# bench's JSON, redirected to a file in $OUT).
#
# The script deletes only what it made: .whl-tpu/ and the install folder carry a mark of
# their own, a folder without it is never emptied, and `wheels` replaces .whl-tpu/ only once
# the new wheels have all arrived. Each variable is checked by name, and every failure exits
# non-zero with its reason on stderr.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() {
    echo "run.sh: $*" >&2
    exit 2
}

# The value of the environment variable $1 (or the default $2): a whole number of seconds,
# at least $3.
seconds() {
    local name=$1 value="${!1:-$2}"
    if ! [[ "$value" =~ ^[0-9]+$ ]] || [ "$((10#$value))" -lt "$3" ]; then
        fail "$name must be a whole number of seconds >= $3, got '$value'"
    fi
    echo "$((10#$value))"
}

await_limit="$(seconds FLOWGRPO_TPU_AWAIT 120 0)"
budget="$(seconds FLOWGRPO_TPU_BUDGET 570 1)"
timeout_seconds=""
if [ -n "${FLOWGRPO_TPU_TIMEOUT:-}" ]; then
    timeout_seconds="$(seconds FLOWGRPO_TPU_TIMEOUT "" 1)"
fi
site="${FLOWGRPO_TPU_SITE-/tmp/flowgrpo-site}"
[ -n "$site" ] || fail "FLOWGRPO_TPU_SITE is empty: name the folder to install into, or unset it"
holder="${FLOWGRPO_TPU_HOLDER-/tmp/flowgrpo-tpu-holder.pid}"
[ -n "$holder" ] || fail "FLOWGRPO_TPU_HOLDER is empty: name the file, or unset it"

wheels=.whl-tpu
# What marks .whl-tpu/ and the install folder as this script's own.
wheels_mark=.made-by-run-sh
site_mark=.flowgrpo-tpu-site
# Not in the TPU machine's index (checked on 2026-12-05): equinox and chex. The versions are
# the ones the CPU suite runs with (pip list in CI's venv).
# beartype: the index's 0.22.9 rejects jaxtyping's NumPy dtype hints under NumPy 2.4.
carried=(equinox==0.13.8 chex==0.1.92 beartype==0.23.1)
# What the library and its tests import, from the machine's own index.
from_index=(
    jaxtyping optax orbax-checkpoint safetensors pillow matplotlib tqdm
    "ml_dtypes>=0.5,<0.7" tensorboardX tensorboard aiohttp hypothesis pytest-xdist pytest-timeout
)
# Carried and installed without its one dependency, huggingface-hub, which serves only
# `Tokenizer.from_pretrained` (a download); the library reads a folder's tokenizer.json.
tokenizers=tokenizers==0.23.3
# Installed apart: its dependencies do not all resolve from the machine's index (2026-12-06:
# opentelemetry-exporter-http-transport); the tests that need it are skipped by name.
optional=(wandb)

# Whether folder $1 is the install folder this script made: its mark, or the stamp of an
# earlier install.
owned_site() {
    [ -f "$1/$site_mark" ] || compgen -G "$1/.installed-*" >/dev/null
}

install() {
    if [ ! -d "$wheels" ]; then
        fail "no $wheels/ here: run 'bash tools/tpu/run.sh wheels' where pip reaches PyPI, and" \
            "carry $wheels"
    fi
    if [ -e "$site" ] && [ ! -d "$site" ]; then
        fail "FLOWGRPO_TPU_SITE=$site is not a folder: name a new or empty folder to install into"
    fi
    if [ -d "$site" ] && ! owned_site "$site" && [ -n "$(ls -A "$site")" ]; then
        fail "FLOWGRPO_TPU_SITE=$site holds files this script did not put there (no $site_mark):" \
            "name a new or empty folder, which the script then owns; nothing was changed"
    fi
    local stamp
    stamp="$site/.installed-$(ls "$wheels" | cksum | cut -d' ' -f1)"
    if [ ! -f "$stamp" ]; then
        # An earlier install of this script's own is replaced whole; an empty folder is taken.
        if owned_site "$site"; then
            rm -rf "$site"
        fi
        mkdir -p "$site"
        touch "$site/$site_mark"
        local started=$SECONDS
        pip=(env PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated --quiet
            --no-cache-dir --disable-pip-version-check --only-binary=:all: --target "$site"
            --index-url file:///opt/pypi/simple --find-links "$wheels")
        "${pip[@]}" "${carried[@]}" "${from_index[@]}"
        "${pip[@]}" --no-deps "$tokenizers"
        local package
        for package in "${optional[@]}"; do
            "${pip[@]}" "$package" || echo "not installed: $package" >&2
        done
        touch "$stamp"
        echo "installed into $site in $((SECONDS - started)) s" >&2
    fi
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site:$PWD"
    export PATH="$site/bin:$PATH"
}

# The process of `test` or `python` that holds the chip. Killed by a `timeout` (which signals
# its whole process group), a JAX process can outlive its command by seconds while it still
# holds libtpu's lock, and a process started meanwhile cannot open the chip ("Internal error
# when accessing libtpu multi-process lockfile"): `test` and `python` first wait for it.
# Whether process $1 runs: not ended, nor ended and not yet reaped (a zombie).
alive() {
    local state
    state="$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$1/stat" 2>/dev/null)" || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

await_chip() {
    local pid waited=0
    pid="$(cat "$holder" 2>/dev/null || true)"
    [ -n "$pid" ] || return 0
    # A process of another name has taken a finished holder's id: nothing to wait for.
    grep -qaE 'python|run\.sh' "/proc/$pid/cmdline" 2>/dev/null || return 0
    while [ "$pid" != "$$" ] && alive "$pid"; do
        if [ "$waited" -ge "$await_limit" ]; then
            echo "process $pid still holds the chip after $waited s; going on" >&2
            return 0
        fi
        [ "$waited" -eq 0 ] && echo "waiting for process $pid, which holds the chip" >&2
        sleep 1
        waited=$((waited + 1))
    done
}

# This process becomes the chip's holder: the caller `exec`s the program next, keeping the
# process id.
hold_chip() {
    await_chip
    echo "$$" >"$holder"
}

case "${1:-}" in
    wheels)
        if [ -e "$wheels" ] && [ ! -f "$wheels/$wheels_mark" ]; then
            fail "$wheels exists and was not made by 'run.sh wheels' (no $wheels/$wheels_mark):" \
                "move it away first; nothing was changed"
        fi
        # Into a new folder first: the old wheels stay until every new one has arrived.
        fresh="$(mktemp -d "$wheels.new.XXXXXX")"
        trap 'rm -rf "$fresh"' EXIT
        if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
            -d "$fresh" "${carried[@]}" "$tokenizers"; then
            fail "pip could not download the wheels (does it reach PyPI?); $wheels is unchanged"
        fi
        touch "$fresh/$wheels_mark"
        if [ -e "$wheels" ]; then
            old="$(mktemp -d "$wheels.old.XXXXXX")"
            mv "$wheels" "$old/"
            mv "$fresh" "$wheels"
            rm -rf "$old"  # the previous .whl-tpu/, marked as this script's own
        else
            mv "$fresh" "$wheels"
        fi
        trap - EXIT
        ls -l "$wheels"
        ;;
    test)
        shift
        install
        hold_chip
        python3 -c 'import jax; print("JAX", jax.__version__, "on", jax.devices())'
        # One process: the chip is held by the test process for the whole run.
        limit=()
        # SIGINT first, as Ctrl-C would, for pytest's summary; SIGKILL 15 s later, since a
        # tiny training run inside a test takes SIGINT as a request to stop and save.
        # The install (about 50 s on a fresh machine) counts: a command's limit is its whole time.
        # The suite's record stops starting tests a minute before it (tests/suite_record.py).
        if [ -n "$timeout_seconds" ]; then
            remaining=$((timeout_seconds - SECONDS))
            remaining=$((remaining > 0 ? remaining : 1))
            limit=(timeout -s INT -k 15 "$remaining")
            export FLOWGRPO_TEST_DEADLINE=$(($(date +%s) + remaining))
        fi
        exec "${limit[@]}" python3 -m pytest -p no:xdist \
            -o addopts="--jaxtyping-packages=flowgrpo_eqx,beartype.beartype" -rfEs "$@"
        ;;
    python)
        shift
        install
        hold_chip
        exec python3 "$@"
        ;;
    await)
        await_chip
        ;;
    suite)
        shift
        folder="${OUT:-suite-records}"
        mkdir -p "$folder"
        stamp="$(date -u +%Y%m%dT%H%M%SZ)"
        folders=()
        while [ $# -gt 0 ] && [ "$1" != "--" ]; do
            folders+=("$1")
            shift
        done
        [ $# -gt 0 ] && shift
        resume="$(IFS=:; echo "${folders[*]}")"
        left=$((budget - SECONDS))
        [ "$left" -ge 1 ] || fail "FLOWGRPO_TPU_BUDGET=$budget s has already passed"
        log="$folder/suite-$stamp.log"
        status=0
        FLOWGRPO_TEST_RECORD="$folder/record-$stamp.jsonl" FLOWGRPO_TEST_RESUME="$resume" \
            FLOWGRPO_TPU_TIMEOUT="$left" bash "$0" test -q -p no:cacheprovider "$@" \
            >"$log" 2>&1 || status=$?
        summary="$(grep -E '(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$log" |
            tail -n 1 || true)"
        echo "suite (exit $status, at ${SECONDS} s): ${summary:-no test ran (the log ends:)}"
        if [ -z "$summary" ]; then
            tail -n 20 "$log" >&2
        fi
        exit "$status"
        ;;
    *)
        sed -n '2,19p' "$0"
        exit 2
        ;;
esac
