"""The identity a provider gives each host it launches, so a caller never reaches a stranger
at a reused address: sent on every request, checked by the host, said by ``/health`` as a
digest (the identity itself is never sent back nor logged)."""

from __future__ import annotations

import hashlib
from typing import Final

HOST_IDENTITY_HEADER: Final = "trio-gym-host-identity"
HEALTH_IDENTITY_FIELD: Final = "identity"


def identity_digest(identity: str) -> str:
    """What ``/health`` says of ``identity``: enough to tell two apart, nothing to forge one."""
    return hashlib.sha256(b"trio-gym-host-identity\0" + identity.encode()).hexdigest()[:16]
