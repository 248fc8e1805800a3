# A sandbox image with this checkout installed, from wheels built on the machine
# (scripts/sandbox_platform.sh builds it with --network none).
FROM trio-gym-base:bookworm
COPY wheels /wheels
RUN python3 -m venv --without-pip /opt/venv \
    && /opt/venv/bin/python "$(ls /wheels/pip-*.whl)/pip" install -q --no-index \
       --find-links /wheels trio-gym \
    && rm -rf /wheels
COPY gym_host.sh /opt/trio-gym/gym_host.sh
ENTRYPOINT ["bash", "/opt/trio-gym/gym_host.sh", "/opt/venv/bin/python"]
