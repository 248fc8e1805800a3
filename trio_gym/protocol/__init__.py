"""What the host and the trainer must agree on, in one place that imports neither.

- :mod:`.identity`: a row's episode identity (``_ng_*`` keys, rollout ids, capture keys);
- :mod:`.export`: the on-disk format of a host's checkpoint export;
- :mod:`.control`: the checkpoint control plane's paths, participants and request models.

Error codes are :class:`trio_gym.errors.ErrorCode`, shared the same way.
"""
