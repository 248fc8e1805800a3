#!/bin/sh
# OpenSandbox runs every sandbox's command through this: execd in the background, then the command.
/opt/opensandbox/execd &
exec "$@"
