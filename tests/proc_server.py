"""Runs one vlkv server (prefill worker, decode worker or gateway) as its own OS process, for fault tests.

    python -m tests.proc_server KIND --model DIR --address-file PATH [--port N] [--prefill ADDR ...] ...

The server binds 127.0.0.1 (a free port unless given), writes its address to ``--address-file`` once it serves, and
runs until SIGTERM/SIGINT (then stops gracefully). ``ServerProcess`` starts one from a test and exposes
its pid, so a test can SIGKILL, SIGSTOP or SIGCONT exactly that process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vlkv.common.security import SecurityConfig, draw_internal_token

ROOT = Path(__file__).resolve().parent.parent
# What a test holds to call the workers' ports: the internal token every ServerProcess is started with (each
# child reads it from VLKV_INTERNAL_TOKEN; a child's own PROC_SECURITY is never used).
PROC_SECURITY = SecurityConfig(internal_token=draw_internal_token())


def _config(args):
    from vlkv.common.config import ModelConfig, PoolConfig, SecurityConfig, ServerConfig, TransferConfig

    return ServerConfig(
        model=ModelConfig(path=args.model),
        security=SecurityConfig(internal_token=os.environ.get("VLKV_INTERNAL_TOKEN", "")),
        pool=PoolConfig(pool_bytes=int(args.pool_mb * (1 << 20)), cache_wait_ms=args.cache_wait_ms),
        transfer=TransferConfig(deadline_s=args.deadline_s, fault_chunk_delay_ms=args.chunk_delay_ms),
        grace_s=0.5,
        keepalive_s=args.keepalive_s,
    )


async def _serve(args) -> None:
    from vlkv.common.logs import setup_logging
    from vlkv.deploy import servers as app

    setup_logging(20, json_lines=True)  # INFO, to stderr
    cfg = _config(args)
    if args.kind == "prefill":
        running = await app.start_prefill_worker(cfg, args.port)
    elif args.kind == "decode":
        running = await app.start_decode_worker(cfg, args.port)
    else:
        running = await app.start_gateway(cfg, args.prefill, args.decode, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tmp = Path(args.address_file + ".tmp")
    tmp.write_text(running.address)
    tmp.rename(args.address_file)  # atomic: the test never reads a half-written address
    await stop.wait()
    await running.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["prefill", "decode", "gateway"])
    p.add_argument("--model", required=True)
    p.add_argument("--address-file", required=True)
    p.add_argument("--prefill", action="append", default=[])
    p.add_argument("--decode", action="append", default=[])
    p.add_argument("--pool-mb", type=float, default=8)
    p.add_argument("--cache-wait-ms", type=int, default=60_000)
    p.add_argument("--deadline-s", type=float, default=60.0)
    p.add_argument("--chunk-delay-ms", type=int, default=0)
    p.add_argument("--keepalive-s", type=float, default=15.0)
    p.add_argument("--port", type=int, default=0)
    asyncio.run(_serve(p.parse_args(argv)))


class ServerProcess:
    """One server in a child process (``start`` returns at once; ``wait_address`` blocks until it serves)."""

    def __init__(self, kind: str, workdir: Path, name: str, *flags: str) -> None:
        self.kind = kind
        self.name = name
        self.address_file = workdir / f"{name}.address"
        self.log_path = workdir / f"{name}.log"
        self.address_file.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
        env["VLKV_INTERNAL_TOKEN"] = PROC_SECURITY.internal_token  # one token for every server of a test run
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "proc_server", kind, "--address-file", str(self.address_file)]
                + list(flags),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=log,
            )
        self.address = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_address(self, timeout: float = 120) -> str:
        end = time.monotonic() + timeout
        while not self.address_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name} did not start in {timeout} s: {self.log_tail()}")
            time.sleep(0.05)
        self.address = self.address_file.read_text()
        return self.address

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as when a machine or container dies."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self) -> None:
        """Ask the server to stop gracefully (``stop`` waits for it)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.proc.terminate()

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


if __name__ == "__main__":
    main()
