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
#
# Exit 0 with the interpreter's path on stdout; 3 when no Python 3.13 is found (the real suite
# then skips, saying why); anything else is a failed build.
set -euo pipefail

version=0.7.0
home=${HOME:-$(cd ~ && pwd)}  # a CI environment may not set HOME
cache=${TRIO_GYM_CACHE:-${XDG_CACHE_HOME:-$home/.cache}/trio-gym}
venv=$cache/nemo-gym-$version
marker=$venv/.trio-gym-complete

if [[ -f "$marker" ]]; then
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
echo "$venv/bin/python"
