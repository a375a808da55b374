"""Launchers and fixtures shared by the tests and the benchmarks: real vLLM engines
(`vllm_engine`), real SGLang servers (`sglang_engine`), the checkpoints they load
(`model_weights`, `hybrid_models`) and an engine child's temp dir (`child_tmp`). Test support
code lives here, not in bench/; bench/'s engine benchmarks import it from here."""
