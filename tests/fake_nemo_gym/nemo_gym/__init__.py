"""A stand-in for NeMo Gym's launcher, for the ``gym`` runner's fast tests (see ``cli/main.py``).

The real nemo-gym is tested by ``tests/test_gym_real.py``; this proves the host's side of the
bargain quickly: what it starts Gym with, and that nothing Gym starts outlives the host.
"""
