"""Parse and validate the deployment files (run by scripts/check-deploy.sh in its cached venv).

* every ``terraform/**/*.tf`` parses with python-hcl2;
* every Kubernetes manifest validates with kubernetes-validate (strict: unknown fields
  fail): the kustomize builds of deploy/k8s (base, overlays, pytorchjob) when kubectl or
  kustomize is installed, else the base files and overlay patches one by one (patches
  merged onto their base object); a PyTorchJob's pod templates are validated as
  PodTemplates (its CRD schema is not in kubernetes-validate);
* docker/compose.yaml parses and names its services.
Prints one line per file or object; exits 1 on any failure.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import hcl2
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest EKS/GKE version supported, the newest
KUSTOMIZATIONS = ("base", "overlays/eks", "overlays/gke", "pytorchjob")

problems: list[str] = []


def fail(message: str) -> None:
    problems.append(message)
    print(f"FAIL {message}")


def check_terraform() -> None:
    files = sorted((ROOT / "terraform").rglob("*.tf"))
    if not files:
        fail("terraform/: no .tf files")
    for path in files:
        try:
            with path.open() as stream:
                hcl2.load(stream)
        except Exception as exc:  # noqa: BLE001 - report every file's error
            fail(f"{path.relative_to(ROOT)}: does not parse: {exc}")
        else:
            print(f"ok   hcl2 parses {path.relative_to(ROOT)}")


def validate(obj: dict[str, Any], where: str) -> None:
    kind = obj.get("kind")
    name = (obj.get("metadata") or {}).get("name")
    if obj.get("apiVersion") == "kubeflow.org/v1" and kind == "PyTorchJob":
        check_pytorchjob(obj, where)
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            at = list(exc.path)
            fail(f"{where}: {kind}/{name} (Kubernetes {version}): {exc.message} at {at}")
            return
        except kubernetes_validate.SchemaNotFoundError as exc:
            fail(f"{where}: {kind}/{name}: no schema ({exc})")
            return
    print(f"ok   kubernetes-validate {where}: {kind}/{name} ({', '.join(KUBE_VERSIONS)})")


def check_pytorchjob(obj: dict[str, Any], where: str) -> None:
    specs = obj.get("spec", {}).get("pytorchReplicaSpecs", {})
    if set(specs) - {"Master", "Worker"} or "Master" not in specs:
        fail(f"{where}: PyTorchJob replica specs must be Master (+ Worker), got {sorted(specs)}")
    for role, spec in specs.items():
        if spec.get("restartPolicy") not in ("OnFailure", "Always", "ExitCode", "Never"):
            fail(f"{where}: PyTorchJob {role}: bad restartPolicy {spec.get('restartPolicy')!r}")
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{obj['metadata']['name']}-{role.lower()}"},
            "template": spec.get("template"),
        }
        validate(template, f"{where} (PyTorchJob {role} pod template)")


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def check_kubernetes() -> None:
    command = kustomize_command()
    if command is None:
        print("note kubectl/kustomize not installed: validating base files and overlay patches")
        check_kubernetes_files()
        return
    for name in KUSTOMIZATIONS:
        result = subprocess.run(
            [*command, str(K8S / name)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            fail(f"deploy/k8s/{name}: {' '.join(command)} failed: {result.stderr.strip()}")
            continue
        for obj in documents(result.stdout):
            validate(obj, f"{' '.join(command[1:])} deploy/k8s/{name}")


def _merge(base: Any, patch: Any) -> Any:
    """A strategic-merge-patch approximation: maps merge, anything else replaces."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            merged[key] = _merge(base.get(key), value)
        return merged
    return copy.deepcopy(patch)


def check_kubernetes_files() -> None:
    """Without kustomize: every manifest file of the base and the PyTorchJob, every
    overlay patch merged onto the base object it patches."""
    base_objects: dict[tuple[str, str], dict[str, Any]] = {}
    for directory in ("base", "pytorchjob"):
        kustomization = yaml.safe_load((K8S / directory / "kustomization.yaml").read_text())
        for resource in kustomization.get("resources", []):
            path = K8S / directory / resource
            if path.is_dir():
                continue
            for obj in documents(path.read_text()):
                base_objects[obj["kind"], obj["metadata"]["name"]] = obj
                validate(obj, f"deploy/k8s/{directory}/{resource}")
        for generator in kustomization.get("configMapGenerator", []):
            data = {f: (K8S / directory / f).read_text() for f in generator.get("files", [])}
            validate(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": generator["name"]},
                    "data": data,
                },
                f"deploy/k8s/{directory} configMapGenerator",
            )
    for overlay in ("eks", "gke"):
        overlay_file = K8S / "overlays" / overlay / "kustomization.yaml"
        kustomization = yaml.safe_load(overlay_file.read_text())
        for patch in kustomization.get("patches", []):
            if "path" not in patch:
                continue  # inline JSON patches: checked by kustomize where it runs
            for obj in documents((K8S / "overlays" / overlay / patch["path"]).read_text()):
                target = base_objects.get((obj["kind"], obj["metadata"]["name"]))
                if target is None:
                    fail(f"overlays/{overlay}/{patch['path']}: patches no base object")
                    continue
                validate(_merge(target, obj), f"deploy/k8s/overlays/{overlay}/{patch['path']}")


def check_compose() -> None:
    path = ROOT / "docker" / "compose.yaml"
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        fail(f"{path.relative_to(ROOT)}: no services mapping")
        return
    print(f"ok   compose parses docker/compose.yaml: services {', '.join(doc['services'])}")


def main() -> int:
    check_terraform()
    check_kubernetes()
    check_compose()
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
