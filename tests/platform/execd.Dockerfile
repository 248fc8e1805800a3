# The execd stand-in image (tests/platform/execd.py): OpenSandbox copies /execd and
# /bootstrap.sh out of it into every sandbox.
FROM trio-gym-base:bookworm
COPY execd.py /execd
COPY bootstrap.sh /bootstrap.sh
RUN chmod 0755 /execd /bootstrap.sh
