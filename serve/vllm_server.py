"""vLLM's OpenAI server as a child process: the target, optionally with a draft exported for
vLLM (`specdistill export --format vllm`), on a loopback port, answering what the online job
needs (`--max-logprobs`, per-request speculation metrics) and keeping its Prometheus
counters (`GET /metrics`, eval/served_metrics.py).

    server = VllmServer(VllmServerSettings(target="runs/target", name="my-target"),
                        draft="exports/v000002", speculation={"method": "draft_model"})
    url = server.start(Path("vllm-v000002.log"))     # returns once /health answers
    ...
    server.stop()

The server runs `python -m vllm.entrypoints.openai.api_server` (vLLM's `vllm serve`) with
this interpreter; on a CPU its threads, reserved cores and KV memory come from
`eval.vllm_engine.cpu_environment`; its engine runs in the server's process with one
executor (no worker processes: each would import vLLM again). Starting takes about 50 s alone
on two cores, minutes beside a loaded server (imports, weights, warm-up): a deployment starts
the next server while the current one serves.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specdistill.eval.vllm_engine import VllmError, VllmSettings, check_installed, cpu_environment
from specdistill.eval.vllm_speculate import speculative_config

ENTRY = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class VllmServerSettings:
    """What every server of a deployment shares: the target (a model directory or hub id),
    the name clients ask for, how vLLM runs (`engine`), γ, the most top log-probabilities a
    request may ask for, the context length, and how long a start may take."""

    target: str
    name: str
    engine: VllmSettings = VllmSettings(kv_cache_gib=1.0, max_num_seqs=16)
    gamma: int = 3
    max_logprobs: int = 20
    max_model_len: int | None = None
    start_timeout_s: float = 600.0

    def argv(self, port: int, draft: str | None, speculation: Mapping | None) -> list[str]:
        """The server's command line on `port`."""
        e = self.engine
        argv = [sys.executable, "-m", ENTRY, "--model", self.target]
        argv += ["--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--dtype", e.dtype, "--seed", str(e.seed), "--max-num-seqs", str(e.max_num_seqs)]
        argv += ["--max-logprobs", str(self.max_logprobs), "--return-tokens-as-token-ids"]
        argv += ["--per-request-spec-decode-metrics", "summary"]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        argv += ["--distributed-executor-backend", "uni"]  # no worker process: starts sooner
        if not e.compile:
            argv.append("--enforce-eager")
        if draft is not None:
            config = speculative_config(draft, speculation, self.gamma)
            argv += ["--speculative-config", json.dumps(config)]
        return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One vLLM server process (the target alone when `draft` is None)."""

    def __init__(
        self,
        settings: VllmServerSettings,
        draft: str | None = None,
        speculation: Mapping[str, object] | None = None,
    ):
        check_installed("a vLLM server")
        self.settings, self.draft, self.speculation = settings, draft, speculation
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    def start(self, log: Path) -> str:
        """Start the server (its output to `log`) and wait until /health answers; VllmError
        naming the log's last lines when it exits or does not answer in time."""
        self.log = Path(log)
        env = dict(os.environ)
        env.update(cpu_environment(self.settings.engine))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the server's process
        argv = self.settings.argv(self.port, self.draft, self.speculation)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VllmError(f"vLLM's server exited ({self.process.returncode}): {self._tail()}")
            if self.healthy():
                return self.url
            time.sleep(1.0)
        self.stop()
        raise VllmError(
            f"vLLM's server did not answer within {self.settings.start_timeout_s:.0f} s: "
            + self._tail()
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its engine's processes too
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)

    def _tail(self, lines: int = 8) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"{self.log}: " + " | ".join(text)
