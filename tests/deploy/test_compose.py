"""docker-compose.yml and docker/ checked without a Docker engine (fast, CI).

``docker-compose config`` (Compose 1.29, Debian's package; ``make test`` installs it with
``make test-deps``, and its absence fails the tests, naming the command) validates the file
against the compose schema it bundles and interpolates it, once per profile. The rest reads
the resolved file: build files and targets exist, bind-mounted host paths exist (or are made
by a make target), every ``python -m <module>`` / script / CLI and every flag a command passes
is real (checked against its ``--help``), ports agree with the servers' defaults, every
``${VAR}`` has a default, and no service carries a secret.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
PROFILES = ["train", "load", "gpu"]
# Host folders the stack writes: absent from a clean clone, made by the make targets (and by
# the compose services themselves: the folders service makes them and hands them to RECSYS_UID).
MADE_BY_MAKE = {
    "runs": "make train / make export (and the trainer/export services)",
    "runs/serve": "make serve (and the gateway-token service, which the load profile waits for)",
    "model_store": "make export (and the export service)",
    "data": "make train (synthetic data, data/cache)",
    "reports": "make loadtest (and locust-master)",
}
LOCUST_MASTER_PORT = 5557  # Locust's own default (its --help says so; checked below)
PROMETHEUS_PORT = 9090  # Prometheus's own default (its --help says so; checked below)
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus.yml"
# Images pulled, not built: pinned to a version (the same as Debian's /usr/bin/prometheus,
# whose --help checks the service's flags)
EXTERNAL_IMAGES = {"prometheus": "prom/prometheus:v2.42.0"}
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.I)


def compose_bin() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        # make test installs it (make test-deps): a missing tool fails, it never skips
        pytest.fail(
            "docker-compose not found: run `make test-deps` (apt-get install docker-compose)"
        )
    return exe


def clean_env() -> dict[str, str]:
    """The environment without the stack's variables: the file's own defaults apply."""
    drop = ("RECSYS_", "PRESET", "NPROC", "FORMATS", "USERS", "SPAWN_RATE", "DURATION", "LOCUST",
            "PROMETHEUS_HOST_PORT")  # fmt: skip
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def compose_config(*profiles: str) -> subprocess.CompletedProcess[str]:
    args = [a for p in profiles for a in ("--profile", p)]
    return subprocess.run(
        [compose_bin(), "-f", str(COMPOSE), *args, "config"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@functools.cache
def resolved() -> dict:
    proc = compose_config(*PROFILES)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def services() -> dict[str, dict]:
    return resolved()["services"]


@pytest.mark.parametrize("profiles", [(), *[(p,) for p in PROFILES], tuple(PROFILES)])
def test_compose_config_is_valid(profiles: tuple[str, ...]) -> None:
    proc = compose_config(*profiles)
    assert proc.returncode == 0, proc.stderr
    assert "is not set" not in proc.stderr, proc.stderr  # a ${VAR} without a default


def test_every_variable_has_a_default() -> None:
    lines = COMPOSE.read_text().splitlines()
    text = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))
    text = text.replace("$$", "")  # escaped: expanded by the container's shell, not compose
    bare = re.findall(r"\$([A-Za-z_]\w*)", text)
    assert not bare, f"use ${{VAR:-default}}, not ${bare}"
    missing = [m[0] for m in re.findall(r"\$\{(\w+)(:?-[^}]*)?\}", text) if not m[1]]
    assert not missing, f"no default for {sorted(set(missing))}"


# --- build: Dockerfiles and targets -----------------------------------------------------------


def test_dockerfiles_and_targets_exist() -> None:
    built = 0
    for name, svc in services().items():
        build = svc.get("build")
        if name in EXTERNAL_IMAGES:
            assert build is None and svc["image"] == EXTERNAL_IMAGES[name], name
            continue
        if build is None:
            image = svc["image"]
            assert any(s.get("image") == image and "build" in s for s in services().values()), (
                f"{name}: image {image} is built by no service"
            )
            continue
        context = Path(build["context"])
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        targets = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", dockerfile.read_text(), re.I | re.M)
        assert build.get("target") in targets, (
            f"{name}: target {build.get('target')} not in {targets}"
        )
        built += 1
    assert built >= 4


def test_dockerignore_keeps_state_and_keys_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", "runs", "model_store", "data", "**/key_file.json"):
        assert entry in ignored


SECRETS = ("**/*.pem", "**/*.key", "**/.env", "**/*token*")


def test_dockerignore_keeps_secrets_out_and_every_source_in() -> None:
    """TLS keys, env files and token files never enter an image, whatever folder they are
    in; no file an image is built from matches (a source named after tokens is kept by a
    ``!`` line), and no Dockerfile copies such a file by name."""
    lines = (ROOT / ".dockerignore").read_text().split()
    for entry in SECRETS:
        assert entry in lines
    kept = [line[1:] for line in lines if line.startswith("!")]

    def excluded(path: Path) -> bool:
        name = path.relative_to(ROOT).as_posix()
        hit = any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path.name, p[3:]) for p in SECRETS)
        return hit and not any(fnmatch.fnmatch(path.name, k[3:]) for k in kept)

    sources = [p for d in ("serving", "recsys_stack", "training", "loadtest", "docker",
                           "requirements", "deploy", "docs", "tests")
               for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]  # fmt: skip
    assert len(sources) > 100
    assert not [p for p in sources if excluded(p)]
    assert excluded(ROOT / "runs" / "serve" / "gateway_token")
    assert excluded(ROOT / "certs" / "server.key") and excluded(ROOT / ".env")
    assert not excluded(ROOT / "serving" / "gateway" / "tokens.py")
    for dockerfile in (ROOT / "docker").glob("*Dockerfile*"):
        copies = re.findall(r"^(?:COPY|ADD)\s+(.*)$", dockerfile.read_text(), re.M)
        assert not [c for c in copies if re.search(r"\.pem|\.key\b|\.env|token", c)], copies


# --- volumes ----------------------------------------------------------------------------------


def test_bind_mounts_exist_or_are_made_by_make() -> None:
    for name, svc in services().items():
        for vol in svc.get("volumes", []):
            source = vol["source"] if isinstance(vol, dict) else vol.split(":")[0]
            if not source.startswith("/"):  # a named volume
                assert source in resolved().get("volumes", {}), f"{name}: {vol}"
                continue
            rel = Path(source).relative_to(ROOT)
            assert rel.exists() or str(rel) in MADE_BY_MAKE, f"{name}: {rel} is not in the repo"


def test_replicas_are_one_scaled_service_the_gateway_finds_by_name() -> None:
    """``--scale torchserve=N`` adds replicas the gateway calls: it resolves the service name
    (dns:///torchserve) and reads each replica's own inference key by its address."""
    svcs = services()
    ts, gateway = svcs["torchserve"], svcs["gateway"]
    assert ts["deploy"]["replicas"] >= 2
    assert not [n for n in svcs if re.fullmatch(r"torchserve-\d+", n)], "static replicas again"
    assert gateway["depends_on"]["torchserve"]["condition"] == "service_healthy"
    argv = shlex.split(command_lines(gateway["command"])[0])
    port = port_defaults()["RECSYS_TS_GRPC_INFERENCE_PORT"]
    assert argv[argv.index("--backend") + 1] == f"dns:///torchserve:{port}"
    keys = argv[argv.index("--key-file") + 1]
    # the gateway reads each replica's inference-only copy, never its full key_file.json
    shared = ts["environment"]["RECSYS_TS_INFERENCE_KEY_FILE"]
    assert keys == shared == "/keys/{host}.json"
    assert not keys.startswith(ts["environment"]["RECSYS_TS_WORKDIR"])
    gpu = svcs["torchserve-gpu"]
    assert "torchserve" in gpu["networks"]["default"]["aliases"], "the GPU replica joins by name"
    assert gpu["environment"]["RECSYS_TS_INFERENCE_KEY_FILE"] == shared
    mounts = [v.split(":") for v in gateway["volumes"]]  # source:target[:ro], as 1.29 prints
    assert all(m[-1] == "ro" for m in mounts), f"the gateway writes nothing: {mounts}"
    ts_mounts = {m.split(":")[1]: m.split(":")[0] for m in ts["volumes"]}
    assert ts_mounts["/keys"] == "gateway-keys", "the replicas share only inference keys"


def port_mapping(p: dict | str) -> tuple[str, int, int]:
    """(host address, published, target) of a ``ports`` entry as Compose 1.29 prints it: a
    mapping, or ``"ADDR:PUBLISHED:TARGET"`` when an address is given."""
    if isinstance(p, str):
        addr, published, target = p.rsplit(":", 2)
        return addr, int(published), int(target.split("/")[0])
    return p.get("host_ip", ""), int(p["published"]), int(p["target"])


def test_gateway_has_a_token_and_is_published_on_loopback() -> None:
    svcs = services()
    gateway = svcs["gateway"]
    token_file = gateway["environment"]["RECSYS_GATEWAY_TOKEN_FILE"]
    assert gateway["depends_on"]["gateway-token"]["condition"] == "service_completed_successfully"
    maker = shlex.split(command_lines(svcs["gateway-token"]["command"])[0])
    assert maker[:3] == ["python", "-m", "serving.gateway.auth"]
    assert token_file == f"/app/{maker[3]}"  # the file the init step makes (WORKDIR /app)
    for name, svc in svcs.items():
        for p in svc.get("ports", []):
            assert port_mapping(p)[0] == "127.0.0.1", f"{name}: {p} is published on every address"


def test_prometheus_scrapes_the_gateway_and_every_torchserve() -> None:
    svcs = services()
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    ports = port_defaults()
    (gateways,) = jobs["gateway"]["dns_sd_configs"]  # both gateways, by their shared alias
    assert (gateways["names"], gateways["type"]) == (["gateways"], "A")
    assert gateways["port"] == ports["RECSYS_GATEWAY_METRICS_PORT"]
    for name in ("gateway", "gateway-2"):
        assert svcs[name]["networks"]["default"]["aliases"] == ["gateways"], name
    (dns,) = jobs["torchserve"]["dns_sd_configs"]  # every replica, as the gateway finds them
    assert (dns["names"], dns["type"]) == (["torchserve"], "A")
    assert dns["port"] == ports["RECSYS_TS_METRICS_PORT"]
    assert str(ports["RECSYS_GATEWAY_METRICS_PORT"]) in svcs["gateway"]["expose"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svcs["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == str(PROMETHEUS_CONFIG)


# --- commands: modules, scripts, flags --------------------------------------------------------


def command_lines(cmd: list[str] | str | None) -> list[str]:
    """Each simple command of a service command or healthcheck, as a shell string."""
    if cmd is None:
        return []
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if argv and argv[0] in ("CMD", "CMD-SHELL"):
        argv = argv[1:]
    if argv[:2] == ["sh", "-c"]:
        return [c.strip() for c in re.split(r"&&|;|\|\|", argv[2]) if c.strip()]
    return [shlex.join(argv)]


def invocations() -> list[tuple[str, list[str], list[str]]]:
    """``(service, program, flags)``: program is ``-m <module>``, a script path or a CLI."""
    out = []
    for name, svc in services().items():
        cmds = [svc.get("command"), svc.get("healthcheck", {}).get("test")]
        for line in (c for cmd in cmds for c in command_lines(cmd)):
            argv = shlex.split(line)
            if argv[0] == "exec":
                argv = argv[1:]
            if argv[0] in ("mkdir", "chown"):  # coreutils (the folders service)
                continue
            if name in EXTERNAL_IMAGES:  # the image's entrypoint takes the command as flags
                argv = [name, *argv]
            if argv[0] == "torchrun":
                i = argv.index("-m")
                out.append((name, ["torchrun"], flags(argv[1:i])))
                argv = ["python", *argv[i:]]
            if argv[0] == "python":
                prog = argv[1:3] if argv[1] == "-m" else argv[1:2]
                out.append((name, prog, flags(argv[1 + len(prog) :])))
            else:
                out.append((name, argv[:1], flags(argv[1:])))
    return out


def flags(args: list[str]) -> list[str]:
    return [a.split("=")[0] for a in args if a.startswith("--")]


@functools.cache
def help_text(prog: tuple[str, ...]) -> str:
    if prog[0] == "-m" or prog[0].endswith(".py"):
        argv = [sys.executable, *prog]
    else:
        argv = [str(BIN / prog[0]) if (BIN / prog[0]).exists() else prog[0]]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"{shlex.join(argv)} --help failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


def test_modules_and_scripts_are_entry_points() -> None:
    for name, prog, _ in invocations():
        if prog[0] == "-m":
            mod = prog[1]
            path = ROOT / Path(*mod.split("."))
            src = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
            assert src.is_file(), f"{name}: python -m {mod}: no {src.relative_to(ROOT)}"
            text = src.read_text()
            runs = "main(" in text if src.name == "__main__.py" else "__main__" in text
            assert "def main(" in text or "import main" in text, f"{name}: {mod} has no main"
            assert runs, f"{name}: python -m {mod} would not run main()"
        elif prog[0].endswith(".py"):
            assert (ROOT / prog[0]).is_file(), f"{name}: {prog[0]} missing"
        else:
            assert prog[0] in ("torchrun", "locust", "prometheus"), f"{name}: {prog[0]}?"


def test_every_flag_is_in_the_programs_help() -> None:
    calls = [c for c in invocations() if c[2]]  # programs called with flags
    progs = sorted({tuple(p) for _, p, _ in calls})
    with ThreadPoolExecutor(len(progs)) as pool:  # the --help runs import torch: in parallel
        texts = dict(zip(progs, pool.map(help_text, progs), strict=True))
    for name, prog, used in calls:
        for flag in used:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", texts[tuple(prog)]), (
                f"{name}: {' '.join(prog)} has no {flag}"
            )


# --- ports and environment --------------------------------------------------------------------


@functools.cache
def port_defaults() -> dict[str, int]:
    """Port variable -> default, read from the configs that declare them."""
    from recsys_stack.config import iter_keys
    from serving.gateway.config import GatewayConfig
    from serving.torchserve.config import TorchServeConfig

    keys = [*iter_keys(TorchServeConfig), *iter_keys(GatewayConfig)]
    out = {k.env: k.default for k in keys if k.env and k.path.endswith("port")}
    assert "RECSYS_GATEWAY_PORT" in out and "RECSYS_TS_GRPC_INFERENCE_PORT" in out
    return out


def test_port_variables_and_defaults_match_the_code() -> None:
    defaults = port_defaults()
    for var, value in re.findall(r"\$\{(RECSYS_\w*PORT):-(\d+)\}", COMPOSE.read_text()):
        assert var in defaults, f"{var} is read by no server"
        assert int(value) == defaults[var], f"{var}: compose {value}, code {defaults[var]}"


def test_published_and_exposed_ports_are_the_defaults() -> None:
    assert f"Defaults to {LOCUST_MASTER_PORT}" in help_text(("locust",))
    assert f"0.0.0.0:{PROMETHEUS_PORT}" in help_text(("prometheus",))
    known = {*port_defaults().values(), LOCUST_MASTER_PORT, PROMETHEUS_PORT}
    published = []
    for name, svc in services().items():
        for p in svc.get("ports", []):
            _, outside, target = port_mapping(p)
            assert target in known, f"{name}: port {p}"
            # the second gateway: the same ports inside, the next ones on the host
            second = {50052, 8001}
            assert outside == target or (name == "gateway-2" and outside in second), p
            published.append(target)
        for p in svc.get("expose", []):
            assert int(p) in known, f"{name}: exposed {p}"
    # the gateway is the public face (gRPC, KServe v2 REST); Prometheus's UI is on loopback too
    gw = port_defaults()
    grpc_http = [gw["RECSYS_GATEWAY_PORT"], gw["RECSYS_GATEWAY_HTTP_PORT"]]
    assert published == [*grpc_http, *grpc_http, PROMETHEUS_PORT]  # gateway, gateway-2


def test_environment_names_are_read_by_the_code_and_hold_no_secret() -> None:
    code = "".join(
        p.read_text() for d in ("serving", "loadtest", "docker") for p in (ROOT / d).rglob("*.py")
    )
    for name, svc in services().items():
        for var, value in (svc.get("environment") or {}).items():
            if var.startswith(("RECSYS_", "LOADTEST_")):
                assert f'"{var}"' in code or f"{var}=" in code, f"{name}: {var} is read by nothing"
            if SECRET_NAME.search(var):
                assert not value or value.startswith("/"), f"{name}: {var} holds a literal value"
            assert not re.fullmatch(r"[A-Za-z0-9_\-]{24,}", str(value or "")), (
                f"{name}: {var} looks like a secret"
            )
