#!/usr/bin/env bash
# Build the Python environment with real NeMo Gym that tests/test_gym_real.py runs against.
#
#   scripts/gym_env.sh            # prints the environment's python when it is ready
#
# nemo-gym 0.7.0 (pinned) from PyPI, in a venv of a Python 3.13 interpreter. The wheel declares
# Requires-Python >=3.13.14; these machines have 3.13.0 (pyenv), where it installs and runs with
# --ignore-requires-python (pip check is clean). About 1.5 GB, a few minutes; built once into
#   ${TRIO_GYM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trio-gym}/nemo-gym-0.7.0
# (outside the checkout) and reused while its marker says it was finished. A venv does not
# survive being moved, so it is built in place: a half-built one (no marker) is removed first.
# Beside it, nemo-gym-0.7.0-wheels: every wheel of its closure (see wheelhouse below).
#
# Exit 0 with the interpreter's path on stdout; 3 when no Python 3.13 is found (the real suite
# then skips, saying why); anything else is a failed build.
set -euo pipefail

version=0.7.0
home=${HOME:-$(cd ~ && pwd)}  # a CI environment may not set HOME
cache=${TRIO_GYM_CACHE:-${XDG_CACHE_HOME:-$home/.cache}/trio-gym}
venv=$cache/nemo-gym-$version
marker=$venv/.trio-gym-complete

wheels=$cache/nemo-gym-$version-wheels

# Every wheel the environment holds, pip (uv's seed) among them: the complete closure a sandbox
# builds Gym's per-server venvs from with no index (tests/test_gym_sandboxed.py), made once beside
# the environment. About 360 MB.
wheelhouse() {
  [[ -f "$wheels/.trio-gym-complete" ]] && return 0
  echo "gym_env.sh: downloading nemo-gym $version's wheels into $wheels" >&2
  rm -rf "$wheels" "$wheels.part"
  # Exactly what the environment holds (pip's resolver, asked again, picks other versions),
  # each as a wheel: one is only an sdist (antlr4-python3-runtime 4.9.3), built here; nemo-gym
  # itself is downloaded apart (pip wheel does not ignore its Requires-Python).
  "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^nemo-gym==' \
    >"$cache/wheels.txt"
  { "$venv/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps \
      --wheel-dir "$wheels.part" -r "$cache/wheels.txt" &&
    "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
      --ignore-requires-python --only-binary :all: --dest "$wheels.part" "nemo-gym==$version"
  } >"$cache/wheels.log" 2>&1 || { tail -20 "$cache/wheels.log" >&2; exit 1; }
  touch "$wheels.part/.trio-gym-complete"
  mv "$wheels.part" "$wheels"
}

if [[ -f "$marker" ]]; then
  wheelhouse
  echo "$venv/bin/python"
  exit 0
fi

# The first candidate that runs and is a 3.13: the one named, pyenv's newest (found by its
# directory: the pyenv command need not be on PATH), then PATH's (a pyenv shim on PATH may name
# a version that is not active, so each is tried, not trusted).
candidates=()
[[ -n "${TRIO_GYM_GYM_BASE_PYTHON:-}" ]] && candidates+=("$TRIO_GYM_GYM_BASE_PYTHON")
pyenv_root=${PYENV_ROOT:-$home/.pyenv}
while IFS= read -r found; do candidates+=("$found"); done < <(
  ls -d "$pyenv_root"/versions/3.13*/bin/python3.13 2>/dev/null | sort -rV)
candidates+=(python3.13)
base=
for candidate in "${candidates[@]}"; do
  if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))' >/dev/null 2>&1; then
    base=$candidate
    break
  fi
done
if [[ -z "$base" ]]; then
  echo "gym_env.sh: no Python 3.13 found (set TRIO_GYM_GYM_BASE_PYTHON); nemo-gym needs it" >&2
  exit 3
fi

echo "gym_env.sh: building nemo-gym $version with $base into $venv" >&2
rm -rf "$venv"
mkdir -p "$cache"
"$base" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --ignore-requires-python "nemo-gym==$version" >&2
"$venv/bin/python" -m pip check >&2
"$venv/bin/python" -c "import nemo_gym.cli.main" >&2
touch "$marker"
wheelhouse
echo "$venv/bin/python"
