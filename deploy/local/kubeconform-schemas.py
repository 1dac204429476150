#!/usr/bin/env python3
"""Writes the JSON schemas kubeconform validates deploy/k8s against (tests/offline/deploy.rs).

    python3 kubeconform-schemas.py OUT CRD_DIR

- OUT/kubernetes/vX.Y.Z-local-strict/<kind>-<group>-<version>.json: the Kubernetes
  API schemas of the PyPI package kubernetes-validate (its kubernetes-json-schema
  data, strict variant: unknown fields are errors). Its files refer to one
  `_definitions.json` by an absolute URL under https://kubernetes.io/api/, which
  kubeconform would try to download; here each `$id` is dropped and each `$ref`
  made relative, so the refs resolve to the `_definitions.json` next to the file.
  Nothing else changes.
- OUT/crds/<kind>-<group>-<version>.json: the openAPIV3Schema of each
  CustomResourceDefinition in CRD_DIR (the Prometheus Operator's, from its Go
  module), as kubeconform's openapi2jsonschema.py converts it: strict
  (`additionalProperties: false` on every object that lists its properties and
  does not keep unknown fields), `nullable` as a null type.

kubeconform then reads them with
    -schema-location 'OUT/kubernetes/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json'
    -schema-location 'OUT/crds/{{ .ResourceKind }}{{ .KindSuffix }}.json'
"""

import json
import sys
from pathlib import Path

import kubernetes_validate
import yaml
from kubernetes_validate.version import __version__ as KV_VERSION

REF_PREFIX = "/api/_definitions.json#"


def relative_refs(node):
    if isinstance(node, dict):
        node.pop("$id", None)
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                if v.startswith(REF_PREFIX):
                    v = "_definitions.json#" + v[len(REF_PREFIX):]
                elif not v.startswith("#"):
                    sys.exit(f"unexpected $ref {v!r}: kubeconform would fetch it")
            out[k] = relative_refs(v)
        return out
    if isinstance(node, list):
        return [relative_refs(x) for x in node]
    return node


def kubernetes(out: Path):
    src = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    dirs = sorted(d for d in src.iterdir() if d.name.endswith("-local-strict"))
    if not dirs:
        sys.exit(f"no *-local-strict schemas in {src}")
    for d in dirs:
        dest = out / "kubernetes" / d.name
        dest.mkdir(parents=True, exist_ok=True)
        for f in d.glob("*.json"):
            schema = relative_refs(json.loads(f.read_text()))
            (dest / f.name).write_text(json.dumps(schema))
    return [d.name for d in dirs]


def strict(node):
    """openapi2jsonschema.py's conversion, plus nullable."""
    if isinstance(node, list):
        return [strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: strict(v) for k, v in node.items()}
    if node.pop("nullable", False) and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    return node


class Loader(yaml.SafeLoader):
    """YAML 1.1 without its `=` "value" tag (a CRD's enum of operators has `=`)."""


Loader.yaml_implicit_resolvers = {
    c: [r for r in rs if r[0] != "tag:yaml.org,2002:value"]
    for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def crds(out: Path, crd_dir: Path):
    dest = out / "crds"
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for f in sorted(crd_dir.glob("*.yaml")):
        for doc in yaml.load_all(f.read_text(), Loader=Loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            kind = spec["names"]["kind"].lower()
            group = spec["group"].split(".")[0]
            for v in spec["versions"]:
                schema = v.get("schema", {}).get("openAPIV3Schema")
                if schema is None:
                    continue
                name = f"{kind}-{group}-{v['name']}.json"
                (dest / name).write_text(json.dumps(strict(schema)))
                written.append(name)
    if not written:
        sys.exit(f"no CustomResourceDefinition in {crd_dir}")
    return written


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out, crd_dir = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    versions = kubernetes(out)
    written = crds(out, crd_dir)
    print(
        f"{out}: kubernetes-validate {KV_VERSION} ({versions[0]} .. {versions[-1]}), "
        f"{len(written)} CRD schemas"
    )


if __name__ == "__main__":
    main()
