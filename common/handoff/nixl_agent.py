"""A worker's NIXL agent: registered memory, remote peers, one-sided writes (``nixl-cu12``, over UCX).

One ``NixlAgent`` per worker (``transport.nixl_agent_for``). The decode worker registers its
KV pool once; the prefill worker registers staging buffers (``StagingPool``). Agent metadata is bytes that
NIXL itself produces and parses (connection info and registration keys, never pickled here); it travels
over the workers' gRPC channel (TLS and tokens as configured), never through NIXL's own listener, which
stays off. A peer is known by its agent name, which carries a per-process token, so a restarted peer is
a new name: ``peer()`` loads its metadata and forgets the stale one; a failure to load or to write is a
``NixlError``, never a crash.

NIXL moves bytes unencrypted and a registered region can be written by any peer holding its metadata:
use it on trusted fabrics only (see README, "KV transport").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import uuid

import numpy as np
import torch

log = logging.getLogger(__name__)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent and backend at INFO otherwise
POLL_S = 0.0002  # the shortest pause between progress calls while a transfer is active
POLL_MAX_S = 0.0005  # the longest (UCX over TCP moves about a socket buffer per progress call)
NOTIF_PREFIX = b"vlkv-kv:"


def notif_key(key: str, layer: int) -> bytes:
    """The notification a sender attaches to layer ``layer``'s write for request ``key``."""
    return NOTIF_PREFIX + key.encode() + b":" + str(layer).encode()


def parse_notif(msg: bytes) -> tuple[str | None, int]:
    """``(key, layer)`` of a ``notif_key`` message, ``(None, -1)`` for anything else (peer bytes: parsed as
    text, never unpickled)."""
    if not isinstance(msg, bytes) or not msg.startswith(NOTIF_PREFIX):
        return None, -1
    key, _, layer = msg[len(NOTIF_PREFIX) :].rpartition(b":")
    try:
        return key.decode(), int(layer)
    except ValueError:  # also UnicodeDecodeError
        return None, -1


class NixlError(Exception):
    """A NIXL operation failed (library missing, bad peer metadata, a write that ended in error)."""


@functools.cache
def nixl_available() -> str:
    """'' when the NIXL Python API (``nixl-cu12``) and its UCX backend load here, else why not."""
    try:
        from nixl_cu12 import nixl_agent  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - missing wheel, missing shared libraries, wrong platform
        return f"nixl is not installed or cannot load: {exc!r}"
    return ""


def mem_type(t: torch.Tensor) -> str:
    return "DRAM" if t.device.type == "cpu" else "VRAM"


def device_id(t: torch.Tensor) -> int:
    return 0 if t.device.type == "cpu" else t.device.index or 0


class NixlAgent:
    def __init__(self, role: str) -> None:
        why = nixl_available()
        if why:
            raise NixlError(why)
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self.name = f"vlkv-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # No progress thread: it spins on a core for ever. The sender progresses its writes while it
            # waits for them (``poll``, ``wait``); a receiver progresses while a transfer writes into it
            # (``watch``); an idle agent costs no CPU.
            conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self._agent = nixl_agent(self.name, conf)
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"cannot start a NIXL agent: {exc!r}") from exc
        if "UCX" not in self._agent.backends:
            raise NixlError("NIXL has no UCX backend here")
        # every call into the agent holds this (its default sync mode has no locks of its own):
        # registrations and peer loads may come from worker threads
        self._lock = threading.RLock()
        self._peers: dict[str, str] = {}  # an address we send to -> the agent name loaded for it
        self._watchers: dict[str, asyncio.Queue] = {}  # request id -> layers its sender reported written
        self._poller: asyncio.Task | None = None

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (its registrations included): what a peer needs to write here."""
        with self._lock:
            return self._agent.get_agent_metadata()

    def register(self, tensors: list[torch.Tensor]):
        with self._lock:
            return self._agent.register_memory(tensors)

    def deregister(self, handle) -> None:
        with self._lock:
            self._agent.deregister_memory(handle)

    def known_peer(self, address: str) -> str:
        return self._peers.get(address, "")

    def peer(self, address: str, name: str, metadata: bytes) -> str:
        """Make ``name`` (the agent behind ``address``) writable; ``metadata`` when it is new to us."""
        with self._lock:
            old = self._peers.get(address)
            if old == name:
                return name
            if not metadata:
                raise NixlError(f"no NIXL metadata for the new peer agent {name!r} at {address}")
            if old:
                self._forget(address)
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001 - stale or corrupt metadata
                raise NixlError(f"cannot load the NIXL metadata of {address}: {exc!r}") from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                self._agent.remove_remote_agent(loaded)
                raise NixlError(f"{address} sent metadata of agent {loaded!r}, not of {name!r}")
            self._peers[address] = name
            return name

    def forget(self, address: str) -> None:
        """Drop the agent loaded for ``address`` (after a failed write: the peer may have restarted)."""
        with self._lock:
            self._forget(address)

    def _forget(self, address: str) -> None:
        name = self._peers.pop(address, "")
        if name:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - already gone
                log.debug("removing NIXL peer %s failed", name, exc_info=True)

    def watch(self, key: str) -> asyncio.Queue:
        """The layers a peer reports written for ``key`` (a request id), as NIXL notifications arrive:
        while anything is watched, one task of the running loop progresses this agent (which also lands
        UCX-over-TCP writes: the target must progress) and hands each ``notif_key(key, layer)`` to its
        queue. A notification only says a write completed; what landed is still checked against the
        sender's checksums. Nothing polls while nothing is watched (no progress thread, no spinning)."""
        q: asyncio.Queue = asyncio.Queue()
        self._watchers[key] = q
        loop = asyncio.get_running_loop()
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._poller = loop.create_task(self._poll())
        return q

    def unwatch(self, key: str, q: asyncio.Queue) -> None:
        if self._watchers.get(key) is q:  # a newer transfer of the same request keeps its own
            del self._watchers[key]

    def progress(self) -> dict:
        """Progress this agent's UCX worker (which also lands UCX-over-TCP writes into it: the target must
        progress) and return the notifications that arrived, by sending agent."""
        with self._lock:
            return self._agent.get_new_notifs()

    async def _poll(self) -> None:
        idle = POLL_S
        while self._watchers:
            try:
                notifs = self.progress()
            except Exception:  # noqa: BLE001
                log.debug("NIXL progress failed", exc_info=True)
                notifs = {}
            got = False
            for msgs in notifs.values():
                for msg in msgs:
                    key, layer = parse_notif(msg)
                    q = self._watchers.get(key) if key is not None else None
                    if q is not None:
                        try:
                            q.put_nowait(layer)
                        except RuntimeError:  # a watcher left behind by a closed event loop
                            self._watchers.pop(key, None)
                        got = True
            # fast while notifications come, backing off to POLL_MAX_S between them (bounded CPU per
            # transfer; a layer's write takes well over POLL_MAX_S at the sizes where it matters)
            idle = POLL_S if got else min(POLL_MAX_S, idle * 2)
            await asyncio.sleep(idle)

    def post(self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str, notif: bytes = b""):
        """Start a WRITE of ``local`` regions (Nx3 uint64: address, bytes, device) into ``remote`` ones of
        ``peer``, with ``notif`` delivered to the peer once it completed; returns the handle for ``wait``
        (or ``poll``). Over shared memory (UCX cma) the bytes are copied inside this call."""
        try:
            with self._lock:
                src = self._agent.get_xfer_descs(local, mem)
                dst = self._agent.get_xfer_descs(remote, mem)
                handle = self._agent.initialize_xfer("WRITE", src, dst, peer, notif)
                state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001
            raise NixlError(f"NIXL write to {peer} could not start: {exc!r}") from exc
        if state == "ERR":
            self.release(handle)
            raise NixlError(f"NIXL write to {peer} failed to post")
        return handle

    def poll(self, pending: list) -> None:
        """Progress the writes in ``pending`` and drop (release) the finished ones; NixlError on one
        that failed."""
        i = 0
        while i < len(pending):
            with self._lock:
                state = self._agent.check_xfer_state(pending[i])
            if state == "DONE":
                self.release(pending.pop(i))
            elif state == "PROC":
                i += 1
            else:
                raise NixlError(f"a NIXL write failed ({state})")

    async def wait(self, handles: list, deadline: float, stop=None) -> None:
        """Wait until every posted write is done; past the monotonic ``deadline``, when ``stop()`` turns
        true, or on an error, every write still in flight is aborted (released) and NixlError raised.
        Checks back off from POLL_S to POLL_MAX_S (each check also progresses the writes)."""
        pause = POLL_S / 4
        try:
            pending = list(handles)
            while True:
                self.poll(pending)
                if not pending:
                    return
                if time.monotonic() > deadline or (stop is not None and stop()):
                    raise NixlError("NIXL writes did not finish in time")
                await asyncio.sleep(pause)
                pause = min(POLL_MAX_S, pause * 1.5)
        finally:
            for h in handles:
                self.release(h)

    def release(self, handle) -> None:
        try:
            with self._lock:
                handle.release()  # aborts a write still in flight; idempotent
        except Exception:  # noqa: BLE001 - a write that could not be cancelled stays with the agent
            log.warning("a NIXL write could not be released")
