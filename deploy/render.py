"""Render a kustomization directory without kustomize: the subset these manifests use.

    python deploy/render.py deploy/k8s/overlays/ha > ha.yaml

Supported: `resources` (files and directories), `components`, `patches` (strategic-merge files;
the target is the patch's kind and name), `namespace`, `labels` (metadata labels), `images`
(`newName`, `newTag`) and `replicas`. Strategic merge here merges maps, and lists of maps by their
`name` key (containers, env, ports, volumes); any other list is replaced. `kubectl kustomize`
renders the same directories; this exists so CI can check them without a kustomize binary.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
_KNOWN_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "patches",
    "namespace",
    "labels",
    "images",
    "replicas",
}


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge, simplified: maps merge, lists of named maps merge by name, the rest is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in [*base, *patch])
    ):
        out_list = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out_list)}
        for item in patch:
            if item["name"] in index:
                out_list[index[item["name"]]] = merge(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("containers", []), *spec.get("initContainers", [])]


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The manifests a kustomization directory renders to."""
    directory = Path(directory)
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if unknown := set(kustomization) - _KNOWN_KEYS:
        raise ValueError(f"{directory}: this renderer does not support {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else _load_all(path)
    by_key = {_key(d): i for i, d in enumerate(docs)}
    if len(by_key) != len(docs):
        raise ValueError(f"{directory}: duplicate resources")
    for component in kustomization.get("components", []):
        comp_dir = directory / component
        comp = yaml.safe_load((comp_dir / "kustomization.yaml").read_text())
        if comp.get("kind") != "Component":
            raise ValueError(f"{comp_dir} is not a Component")
        for entry in comp.get("resources", []):
            docs += _load_all(comp_dir / entry)
        docs = _patch(docs, comp_dir, comp.get("patches", []))
    docs = _patch(docs, directory, kustomization.get("patches", []))
    for replicas in kustomization.get("replicas", []):
        matches = [d for d in docs if d["metadata"]["name"] == replicas["name"] and "replicas" in d.get("spec", {})]
        if not matches:
            raise ValueError(f"{directory}: replicas for unknown {replicas['name']}")
        for doc in matches:
            doc["spec"]["replicas"] = replicas["count"]
    for label_set in kustomization.get("labels", []):
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    for image in kustomization.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    new_name = image.get("newName", name)
                    new_tag = image.get("newTag", tag)
                    container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name
    if namespace := kustomization.get("namespace"):
        for doc in docs:
            if doc["kind"] not in _CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    return docs


def _patch(docs: list[dict[str, Any]], directory: Path, patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for entry in patches:
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only file patches without explicit targets are supported")
        for patch in _load_all(directory / entry["path"]):
            targets = [i for i, d in enumerate(docs) if _key(d) == _key(patch)]
            if not targets:
                raise ValueError(f"{directory}: patch {entry['path']} matches no resource {_key(patch)}")
            for i in targets:
                docs[i] = merge(docs[i], patch)
    return docs


def main(argv: list[str]) -> int:
    """Print the rendered manifests of each directory given as one YAML stream."""
    for directory in argv:
        sys.stdout.write(yaml.safe_dump_all(render(directory), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
