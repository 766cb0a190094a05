"""The usage journal's sync process (``journal_sync.ProcessSyncer``'s child): it only ``fdatasync``s.

Run as ``python -I journal_sync_worker.py FD`` (isolated, standard library only: it starts in tens of
milliseconds and imports nothing of the gateway). FD is one end of a ``SOCK_SEQPACKET`` socket pair:
each message from the gateway carries the descriptors of one batch's files (``SCM_RIGHTS``: the same
open files, so the same data and error state), and each answer is one message, the first ``errno``
met (0: every file synced), in the order the batches came. End of file (the gateway closed its end,
or died) ends this process.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys

MAX_FDS = 64
ANSWER = struct.Struct("=i")


def serve(channel: socket.socket) -> None:
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, 16, MAX_FDS)
        except InterruptedError:
            continue
        if not message:
            return
        error = 0
        for fd in fds:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                error = error or exc.errno or -1
            finally:
                os.close(fd)
        channel.send(ANSWER.pack(error))


if __name__ == "__main__":
    # Ctrl-C at a terminal reaches the whole process group: the gateway's shutdown still has batches
    # to sync, and this process ends when the gateway closes its end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with socket.socket(fileno=int(sys.argv[1])) as channel:
        try:
            serve(channel)
        except (BrokenPipeError, ConnectionResetError):  # the gateway is gone: nobody waits
            pass
