"""The vLLM connector's default model id follows the weights (`kvtier.integrations.common.identity`,
through vLLM's adapter `kvtier.integrations.vllm.layout.default_model_id`).

Real files: safetensors checkpoints written with `safetensors`, a Hugging Face cache laid out as
huggingface_hub lays it out. The engine-level proof (weights rewritten in place, engine
restarted, no hit) is `test_vllm_connector.py::test_weights_rewritten_in_place_miss`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvtier.integrations.common.identity import hub_revision, weights_digest
from kvtier.integrations.vllm.layout import default_model_id


def write(path: Path, seed: int, shape: tuple[int, int] = (64, 32)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {f"layers.{i}.w": (rng.standard_normal(shape) * 0.02).astype(np.float16)
               for i in range(3)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    return path


def mc(model: Path | str, dtype: str = "torch.bfloat16", quant: str | None = None,
       revision: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(model=str(model), dtype=dtype, quantization=quant, revision=revision)


AUTO = SimpleNamespace(load_format="auto")


def test_local_id_follows_the_files_not_the_path(tmp_path: Path) -> None:
    a = write(tmp_path / "a" / "m", 0)
    copy = tmp_path / "b" / "m"
    shutil.copytree(a, copy)
    ida = default_model_id(mc(a), AUTO, 0)
    assert ida.startswith("m@w:") and ida.endswith("/bfloat16")
    assert default_model_id(mc(copy), AUTO, 0) == ida  # same files elsewhere: same KV
    # rewritten in place: same names, sizes, header; other values
    size = (a / "model.safetensors").stat().st_size
    write(a, 1)
    assert (a / "model.safetensors").stat().st_size == size
    assert default_model_id(mc(a), AUTO, 0) != ida
    write(a, 0)
    assert default_model_id(mc(a), AUTO, 0) == ida  # the same weights again: the same id


def test_one_changed_tensor_changes_the_digest(tmp_path: Path) -> None:
    """A fine-tune that leaves most tensors alone still changes the id: every tensor is
    sampled, not only the file's first bytes."""
    m = write(tmp_path / "m", 0)
    before = weights_digest(m)
    from safetensors.numpy import load_file

    tensors = load_file(str(m / "model.safetensors"))
    t = tensors["layers.2.w"]
    t[len(t) // 2:] += np.float16(0.01)  # the second half of the last tensor only
    save_file(tensors, str(m / "model.safetensors"))
    assert weights_digest(m) != before


def test_config_dtype_and_quantization_are_part_of_the_id(tmp_path: Path) -> None:
    m = write(tmp_path / "m", 0)
    base = default_model_id(mc(m), AUTO, 0)
    assert default_model_id(mc(m, dtype="torch.float16"), AUTO, 0) != base
    assert default_model_id(mc(m, quant="fp8"), AUTO, 0) == base + "/q:fp8"
    (m / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                               "rope_theta": 1e6}))
    assert default_model_id(mc(m), AUTO, 0) != base
    (m / "notes.txt").write_text("not a weight file")
    (m / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    assert default_model_id(mc(m), AUTO, 0) == base


def test_dummy_weights_are_named_by_their_seed(tmp_path: Path) -> None:
    dummy = SimpleNamespace(load_format="dummy")
    assert default_model_id(mc(tmp_path), dummy, 3) == f"{tmp_path}@dummy-seed3/bfloat16"
    assert default_model_id(mc(tmp_path), dummy, 3) != default_model_id(mc(tmp_path), dummy, 4)


def test_hub_branch_resolves_to_its_snapshot_commit(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    assert hub_revision("org/name", None) == commit
    assert default_model_id(mc("org/name"), AUTO, 0) == f"org/name@{commit}/bfloat16"
    (repo / "refs" / "main").write_text("f" * 40)  # the branch moved: another id
    (repo / "snapshots" / ("f" * 40)).mkdir()
    (repo / "snapshots" / ("f" * 40) / "config.json").write_text("{}")
    assert hub_revision("org/name", "main") == "f" * 40
    assert hub_revision("org/name", commit) == commit  # a commit is its own answer


def test_unresolvable_hub_revision_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvtier.integrations"):
        assert hub_revision("org/absent", "main", "kv_connector_extra_config") == "main"
    assert "moves with the branch: pin it with model_id in kv_connector_extra_config" \
        in caplog.text
