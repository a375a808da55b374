"""A real SGLang server (`python -m sglang.launch_server`, SGLang 0.5.23 from its own venv) on
this CPU, with HiCache and an L3 storage backend (kvtier through SGLang's dynamic loader, or
SGLang's own `file` backend), for the SGLang tests and `bench.sglang_ttft`.

    model = write_model(tmp / "model")                        # config + real weights, local
    srv = SglangServer(tmp / "s1", model, socket=daemon.socket).start()   # ~1-3 min here
    out = srv.generate(prompt_ids, max_new_tokens=8)          # Gen(tokens, cached, storage, s)
    srv.flush(); srv.close()

The SGLang venv is `$KVTIER_SGLANG_PYTHON`, else `.venv-sglang/bin/python` (made by
`scripts/venv.sh` profile `sglang`); `sglang_python()` is None without one. SGLang on a CPU
needs the test-only shims of tests/sglang_shims/ (put on the server's PYTHONPATH here; see its
README). Prompts are token ids (`--skip-tokenizer-init`): no tokenizer, nothing downloaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket as _socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

from tests.support.child_tmp import child_tmpdir

ROOT = Path(__file__).resolve().parents[2]
SHIMS = ROOT / "tests" / "sglang_shims"
PAGE = 16
BACKEND = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang.backend",
           "class_name": "KvtierStorage", "interface_v1": 1,
           "hicache_storage_pass_prefix_keys": True, "verify_sample": 0.0}


def sglang_python() -> Path | None:
    env = os.environ.get("KVTIER_SGLANG_PYTHON")
    p = Path(env) if env else ROOT / ".venv-sglang" / "bin" / "python"
    return p if p.exists() else None


def write_model(path: Path, *, hidden: int = 256, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 512, vocab: int = 1024,
                seed: int = 0) -> Path:
    """A Llama config and safetensors weights drawn with std 1/sqrt(fan_in) (norms 1), so
    attention, hence the KV, shapes the output; the same files for one seed."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": intermediate, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": layers,
           "vocab_size": vocab, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
           "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(torch.bfloat16)

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16),
         "lm_head.weight": w(vocab, hidden), "model.norm.weight": ones}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
              p + "mlp.gate_proj.weight": w(intermediate, hidden),
              p + "mlp.up_proj.weight": w(intermediate, hidden),
              p + "mlp.down_proj.weight": w(hidden, intermediate),
              p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones}
    save_file({k: v.clone() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


def page_bytes(*, layers: int = 2, kv_heads: int = 2, head_dim: int = 64) -> int:
    return 2 * layers * PAGE * kv_heads * head_dim * 2


class Gen(NamedTuple):
    tokens: list[int]
    cached: int
    """SGLang's cached_tokens: prompt tokens not computed (device + host + storage)."""
    storage: int
    """Of those, the ones its L3 backend supplied (`cached_tokens_details["storage"]`)."""
    seconds: float
    """Wall time of the request (with max_new_tokens=1: the time to first token)."""


def free_port() -> int:
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangServer:
    """`storage`: "kvtier" (the backend, on `socket`), "file" (SGLang's, under workdir) or
    None (HiCache without L3). `extra`: more backend extra-config keys."""

    def __init__(self, workdir: Path, model: Path, *, socket: Path | None = None,
                 storage: str | None = "kvtier", extra: dict[str, Any] | None = None,
                 max_tokens: int = 16384, threads: int = 1) -> None:
        python = sglang_python()
        if python is None:
            raise RuntimeError("no SGLang venv: run scripts/venv.sh (profile sglang) or set "
                               "KVTIER_SGLANG_PYTHON")
        self.workdir, self.port = workdir, free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        args = [str(python), "-m", "sglang.launch_server", "--model-path", str(model),
                "--skip-tokenizer-init", "--device", "cpu", "--attention-backend",
                "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                "--host", "127.0.0.1", "--port", str(self.port), "--random-seed", "0",
                "--mem-fraction-static", "0.2", "--max-total-tokens", str(max_tokens),
                "--page-size", str(PAGE), "--chunked-prefill-size", str(max_tokens),
                "--enable-hierarchical-cache", "--hicache-ratio", "2",
                "--hicache-io-backend", "direct",
                "--hicache-mem-layout", "layer_first",
                "--hicache-storage-prefetch-policy", "wait_complete"]
        # its own TMPDIR (SGLang's ZMQ IPC files, the CuTe DSL cache), removed by close()
        self.tmp = child_tmpdir(workdir)
        env = {**os.environ, "PYTHONPATH": f"{SHIMS}{os.pathsep}{ROOT}", "TMPDIR": str(self.tmp),
               "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        if storage == "kvtier":
            cfg = {**BACKEND, "prefetch_threshold": PAGE, "socket": str(socket),
                   **(extra or {})}
            args += ["--hicache-storage-backend", "dynamic",
                     "--hicache-storage-backend-extra-config", json.dumps(cfg)]
        elif storage == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(workdir / "files")
            args += ["--hicache-storage-backend", "file",
                     "--hicache-storage-backend-extra-config",
                     json.dumps({"prefetch_threshold": PAGE, **(extra or {})})]
        self.args, self.env = args, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600.0) -> SglangServer:
        self.tmp.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.workdir,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited {self.proc.returncode}:\n{self.tail()}")
            if "fired up and ready" in self.log():
                return self
            time.sleep(1)
        self.close()
        raise RuntimeError(f"SGLang not ready after {timeout} s:\n{self.tail()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return "\n".join(line for line in self.log().splitlines()
                         if "server_args=" not in line)[-chars:]

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> bytes:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return bytes(r.read())

    def generate(self, ids: list[int], max_new_tokens: int = 8,
                 timeout: float = 300.0) -> Gen:
        started = time.perf_counter()
        out = json.loads(self._post("/generate", {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}, timeout))
        seconds = time.perf_counter() - started
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return Gen(list(out["output_ids"]), int(meta.get("cached_tokens", 0)),
                   int(details.get("storage", 0)), seconds)

    def flush(self, timeout: float = 60.0) -> None:
        """Empties SGLang's device and host caches (L1, L2); its L3 keeps its pages."""
        deadline = time.monotonic() + timeout
        before = self.log().count("Cache flushed successfully")
        while time.monotonic() < deadline:
            with contextlib.suppress(urllib.error.URLError):
                self._post("/flush_cache", None, 30)
            if self.log().count("Cache flushed successfully") > before:
                return
            time.sleep(0.5)
        raise RuntimeError(f"SGLang did not flush its cache:\n{self.tail()}")

    def close(self) -> None:
        """Stops the server (its whole process group) and removes its TMPDIR."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> SglangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
