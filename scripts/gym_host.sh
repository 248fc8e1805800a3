#!/usr/bin/env bash
# The entry a sandbox image runs: start the trio_gym host with an explicitly named runtime.
#
#   gym_host.sh RUNTIME [trio-gym serve arguments...]
#
# RUNTIME is the Python interpreter whose environment has trio_gym installed (for example
# /opt/venv/bin/python). It must be given: there is deliberately no fallback to a default path,
# because a default names a file that may not exist in this image and fails late and obscurely.
# NMP_* variables configure the host (see the README); the host listens on all interfaces unless
# NMP_RUNTIME_HTTP_HOST names one. When NMP_ENVIRONMENT_PATH names the
# environment package, it goes first on PYTHONPATH so a runner shipped inside the package
# (--runner mypackage.module:factory) can be imported.
set -euo pipefail

usage="usage: gym_host.sh RUNTIME [trio-gym serve arguments...]"
if [[ $# -lt 1 || -z "${1:-}" ]]; then
  echo "gym_host.sh: no runtime given; name the Python interpreter that has trio_gym installed" >&2
  echo "$usage" >&2
  exit 2
fi
runtime=$1
shift
if [[ ! -x "$runtime" || -d "$runtime" ]]; then
  echo "gym_host.sh: runtime '$runtime' is not an executable file" >&2
  echo "$usage" >&2
  exit 2
fi
if [[ "$("$runtime" -c 'import trio_gym; print("trio_gym ok")' 2>/dev/null)" != "trio_gym ok" ]]; then
  echo "gym_host.sh: runtime '$runtime' cannot import trio_gym; install it into that environment" >&2
  exit 2
fi

# A sandbox publishes the host's port from outside, where loopback reaches nothing: listen on
# every interface unless the launcher names an address (a --host flag still wins). On a network
# the sandboxes share with the machine (host networking) every interface is the machine's: a
# launcher there names 127.0.0.1, as trio_gym's providers do.
export NMP_RUNTIME_HTTP_HOST=${NMP_RUNTIME_HTTP_HOST:-0.0.0.0}

package=${NMP_ENVIRONMENT_PATH:-}
if [[ -n "$package" && -d "$package" ]]; then
  # No empty entry: an empty PYTHONPATH element means the current directory.
  export PYTHONPATH="$package${PYTHONPATH:+:$PYTHONPATH}"
fi

exec "$runtime" -m trio_gym serve "$@"
