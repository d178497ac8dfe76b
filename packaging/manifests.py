#!/usr/bin/env python3
"""Checks and renders the manifests we ship (packaging/validate runs it in its venv).

check FILE...     every object of every YAML file, strictly (unknown fields are errors):
                  Kubernetes' own kinds against the Kubernetes schemas (kubernetes-validate)
                  for each version of --kubernetes (default: PACKAGING_KUBERNETES_VERSIONS);
                  Cluster API, cert-manager, Prometheus Operator and clusterctl kinds against
                  the schemas in packaging/schemas/ (written for this project from those
                  projects' CRDs and Go types; each file names its source). A kind with no
                  schema is an error, not a pass. The objects that a ClusterResourceSet's
                  Secret carries (type addons.cluster.x-k8s.io/resource-set) are checked too.
render FILE [VAR=VALUE]...
                  substitutes clusterctl's variables, `${VAR}` and `${VAR:=default}`
                  (cmd/clusterctl/client/yamlprocessor in kubernetes-sigs/cluster-api), from
                  the arguments, else the default; a variable with neither is an error that
                  names it, as clusterctl's is. Prints the result.
variables FILE    the variables a file uses, one a line: NAME or NAME=default.
promql FILE...    parses every PromQL expression: the `expr` of each PrometheusRule rule in
                  YAML files, each ```promql block of Markdown files (promql-parser, the
                  Python binding of the Rust crate, from PyPI); a query that does not parse,
                  or a file with none, is an error. A broken query must fail first.
selftest FILE...  proves that check is strict for every kind in the files: a copy of one
                  object of each kind with an unknown field (in spec, else at the top) must
                  fail, and every schema in packaging/schemas/ must have been used.
"""
import os
import re
import sys
from pathlib import Path

import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"
# ${VAR} or ${VAR:=default}; VAR as clusterctl's provider contract has it ([A-Z0-9_]+).
VARIABLE = re.compile(r"\$\{\s*([A-Z0-9_]+)\s*(?::=([^}]*))?\}")
RESOURCE_SET_SECRET = "addons.cluster.x-k8s.io/resource-set"


def fail(message):
    print(f"manifests.py: {message}", file=sys.stderr)
    sys.exit(1)


def own_schema(obj):
    """Our schema for the object's apiVersion and kind, or None."""
    api_version = obj.get("apiVersion", "")
    group, _, version = api_version.rpartition("/")
    if not group:
        return None
    path = SCHEMAS / f"{group}_{version}_{obj.get('kind', '')}.yaml".lower()
    if not path.exists():
        return None
    return path, yaml.safe_load(path.read_text())


def is_kubernetes_group(api_version):
    """Kinds of Kubernetes itself: the core group (v1) and groups without a dot or under
    k8s.io (apps, policy, rbac.authorization.k8s.io, ...), except CRD-defined x-k8s.io."""
    group = api_version.rpartition("/")[0]
    return "." not in group or (group.endswith(".k8s.io") and not group.endswith("x-k8s.io"))


def objects_of(path):
    try:
        docs = list(yaml.safe_load_all(Path(path).read_text()))
    except yaml.YAMLError as e:
        fail(f"{path}: not YAML: {e}")
    return [d for d in docs if d is not None]


def name_of(obj):
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{obj.get('kind')} {ns + '/' if ns else ''}{meta.get('name')}"


def check(files, versions):
    objects = [(f, obj) for f in files for obj in objects_of(f)]
    errors, count = check_objects(objects, versions)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        fail(f"{len(errors)} error(s) in {count} object(s)")
    print(f"manifests.py: {count} object(s) in {len(files)} file(s) valid", file=sys.stderr)


def selftest(files, versions):
    """Every kind shipped, broken on purpose, must fail; every schema must be used."""
    import copy

    seen = {}
    for f in files:
        for obj in objects_of(f):
            seen.setdefault((obj.get("apiVersion"), obj.get("kind")), (f, obj))
    used = set()
    problems = []
    for (api_version, kind), (f, obj) in sorted(seen.items()):
        schema = own_schema(obj)
        if schema is not None:
            used.add(schema[0].name)
        broken = copy.deepcopy(obj)
        target = broken["spec"] if isinstance(broken.get("spec"), dict) else broken
        target["inplaceBrokenOnPurpose"] = True
        errors, _ = check_objects([(f, broken)], versions)
        if not any("inplaceBrokenOnPurpose" in e for e in errors):
            problems.append(f"{api_version} {kind}: an unknown field passed the check ({errors})")
    for path in sorted(SCHEMAS.glob("*.yaml")):
        if path.name not in used:
            problems.append(f"packaging/schemas/{path.name}: no object of its kind was checked")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        fail(f"selftest: {len(problems)} problem(s)")
    print(f"manifests.py: selftest: each of {len(seen)} kind(s) refuses an unknown field; "
          f"all {len(used)} schemas used", file=sys.stderr)


def check_objects(objects, versions):
    """Errors of the (file, object) pairs, and how many objects were checked."""
    import jsonschema
    import kubernetes_validate

    errors = []
    count = 0

    def check_object(obj, where):
        nonlocal count
        count += 1
        if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
            errors.append(f"{where}: not a Kubernetes object (no apiVersion and kind)")
            return
        what = f"{where}: {obj['apiVersion']} {name_of(obj)}"
        schema = own_schema(obj)
        if schema is not None:
            path, body = schema
            validator = jsonschema.Draft202012Validator(body)
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
                at = ".".join(str(p) for p in e.path) or "(the object)"
                errors.append(f"{what}: {at}: {e.message} (schema {path.name})")
        elif is_kubernetes_group(obj["apiVersion"]):
            for version in versions:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    at = ".".join(str(p) for p in e.path) or "(the object)"
                    errors.append(f"{what}: Kubernetes {version}: {at}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError:
                    errors.append(f"{what}: Kubernetes {version} has no such kind")
        else:
            errors.append(
                f"{what}: no schema for this kind: add "
                "packaging/schemas/" + f"{obj['apiVersion'].replace('/', '_')}_{obj['kind']}.yaml".lower()
            )
        # A ClusterResourceSet's Secret carries objects for the workload clusters.
        if obj.get("kind") == "Secret" and obj.get("type") == RESOURCE_SET_SECRET:
            for field in ("stringData", "data"):
                for key, value in (obj.get(field) or {}).items():
                    if field == "data":
                        import base64
                        value = base64.b64decode(value).decode()
                    for inner in yaml.safe_load_all(value):
                        if inner is not None:
                            check_object(inner, f"{what} {field}.{key}")

    for f, obj in objects:
        check_object(obj, f)
    return errors, count


def promql(files):
    import promql_parser

    def parses(query):
        try:
            promql_parser.parse(query)
            return None
        except Exception as e:  # the binding raises its own error types
            return str(e)

    if parses("sum(rate(inplace_agent_plans_total[5m])") is None:
        fail("promql: an unclosed parenthesis parsed: the parser accepts anything")
    errors = []
    count = 0
    for f in files:
        queries = []
        if f.endswith(".md"):
            blocks = re.findall(r"```promql\n(.*?)```", Path(f).read_text(), re.S)
            queries = [q for b in blocks for q in b.splitlines() if q.strip()]
        else:
            for obj in objects_of(f):
                if obj.get("kind") == "PrometheusRule":
                    for group in obj["spec"]["groups"]:
                        queries += [rule["expr"] for rule in group["rules"]]
        if not queries:
            errors.append(f"{f}: no PromQL found")
        for q in queries:
            count += 1
            error = parses(q)
            if error is not None:
                errors.append(f"{f}: {q}: {error}")
    if errors:
        print("\n".join(errors), file=sys.stderr)
        fail(f"promql: {len(errors)} error(s)")
    print(f"manifests.py: {count} PromQL queries in {len(files)} file(s) parse", file=sys.stderr)


def variables(text):
    found = {}
    for m in VARIABLE.finditer(text):
        found.setdefault(m.group(1), m.group(2))
    return found


def render(path, assignments):
    text = Path(path).read_text()
    values = {}
    for a in assignments:
        name, sep, value = a.partition("=")
        if not sep:
            fail(f"render: {a!r} is not VAR=VALUE")
        values[name] = value
    missing = [n for n, d in variables(text).items() if d is None and n not in values]
    if missing:
        fail(f"render {path}: value for variables [{', '.join(sorted(missing))}] is not set")

    def substitute(m):
        return values.get(m.group(1), m.group(2) if m.group(2) is not None else "")

    sys.stdout.write(VARIABLE.sub(substitute, text))


def main(argv):
    if len(argv) < 2:
        fail(__doc__)
    command, args = argv[1], argv[2:]
    if command in ("check", "selftest"):
        versions = os.environ.get("PACKAGING_KUBERNETES_VERSIONS", "1.34").split()
        if args[:1] == ["--kubernetes"]:
            versions, args = args[1].split(), args[2:]
        if not args:
            fail(f"{command}: no files")
        (check if command == "check" else selftest)(args, versions)
    elif command == "promql" and args:
        promql(args)
    elif command == "render" and args:
        render(args[0], args[1:])
    elif command == "variables" and len(args) == 1:
        for name, default in variables(Path(args[0]).read_text()).items():
            print(name if default is None else f"{name}={default}")
    else:
        fail(__doc__)


if __name__ == "__main__":
    main(sys.argv)
