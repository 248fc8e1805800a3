"""The bounds every HTTP connection lives within, in either role."""

from __future__ import annotations

import attrs


@attrs.frozen
class HttpLimits:
    """Sizes and times that keep one connection from holding the process hostage.

    Each bound answers "what if the peer never stops / never starts / never reads":

    ``max_head_bytes``
        The largest request or response head (request line plus headers). 16 KiB is h11's own
        default and Node's; nginx allows 4 x 8 KiB. Our callers send a handful of headers.
    ``read_timeout_s``
        The whole head must arrive within this, counted from the first read (nginx's
        ``client_header_timeout`` is 60 s); a body may go this long without a byte (nginx's
        ``client_body_timeout`` works the same way).
    ``send_timeout_s``
        How long one write may wait for the peer to take bytes before the peer is given up as
        gone. It also bounds every shielded write (see :meth:`HttpConnection.send`), so it is
        the longest a cancellation can be held back.
    ``min_body_rate``
        Bytes per second a request body must average (beyond ``read_timeout_s`` of grace), so
        a peer trickling a byte at a time cannot hold a connection slot for hours (Apache's
        mod_reqtimeout does the same with 500 bytes/s; 8 KiB/s is still a modem's speed).
    ``receive_bytes``
        The most a body read asks the kernel for at once.
    ``write_bytes``
        How much one bounded write carries: large enough that framing and per-write overhead
        vanish, small enough to cross any working link well within ``send_timeout_s``.
    ``drain_timeout_s`` / ``drain_max_bytes``
        After our answer, how long and how much of the peer's unread upload we read and discard
        so that closing does not send a reset that would destroy the answer (a 50 MB upload on
        loopback drains in well under a second; a slow link needs seconds).
    """

    max_head_bytes: int = 16 * 1024
    read_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    min_body_rate: float = 8 * 1024
    receive_bytes: int = 64 * 1024
    write_bytes: int = 256 * 1024
    drain_timeout_s: float = 10.0
    drain_max_bytes: int = 64 * 1024 * 1024
