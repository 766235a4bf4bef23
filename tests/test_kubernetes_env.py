"""The Kubernetes manifest of docs/howto-recovery.md: it has what a run needs (an Indexed
Job, a headless Service naming the root, the secret from a Secret, ``restartPolicy:
OnFailure``), and ``lampdist.launch.from_env`` reads the environment each of its pods gets
right. No cluster runs here: the test builds a pod's environment from the manifest as the
kubelet would (the completion index annotation, the Secret's volume)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import lampdist.launch

yaml = pytest.importorskip("yaml")

DOC = Path(__file__).parents[1] / "docs" / "howto-recovery.md"
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def section() -> str:
    text = DOC.read_text()
    start = text.index("## Under Kubernetes")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def manifest() -> dict[str, dict[str, Any]]:
    """The section's YAML documents by kind."""
    (block,) = re.findall(r"```yaml\n(.*?)```", section(), flags=re.DOTALL)
    return {doc["kind"]: doc for doc in yaml.safe_load_all(block)}


def pod_environment(index: int, secret_keys: dict[str, bytes], root: Path) -> dict[str, str]:
    """The environment of the Job's pod ``index``, with the Secret's volume under ``root``
    (each key a file, as the kubelet mounts it)."""
    job = manifest()["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    environ = {}
    for variable in container["env"]:
        if "value" in variable:
            environ[variable["name"]] = variable["value"]
        else:
            assert variable["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION
            environ[variable["name"]] = str(index)
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]]["secret"]
        assert mount.get("readOnly") is True
        here = root / secret["secretName"]
        here.mkdir(parents=True, exist_ok=True)
        for key, value in secret_keys.items():
            (here / key).write_bytes(value)
        for name, value in environ.items():
            if value.startswith(mount["mountPath"].rstrip("/") + "/"):
                environ[name] = str(here / value[len(mount["mountPath"]) :].lstrip("/"))
    return environ


def test_the_manifest_is_an_indexed_job_behind_a_headless_service() -> None:
    kinds = manifest()
    service, job = kinds["Service"], kinds["Job"]
    name = job["metadata"]["name"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert pod["restartPolicy"] == "OnFailure"  # a failed rank restarts with its index
    (container,) = pod["containers"]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert spec["completions"] == spec["parallelism"] == int(env["WORLD_SIZE"])
    # headless, selecting the Job's pods (the Job controller labels them job-name: NAME)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": name}
    # pod i of an Indexed Job is host NAME-i; with the Service as subdomain the root is
    # NAME-0.SERVICE
    assert pod["subdomain"] == service["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{name}-0.{pod['subdomain']}"
    # the secret from a Secret's volume, never a value in the manifest
    assert "LAMPDIST_SECRET" not in env
    (volume,) = pod["volumes"]
    assert volume["secret"]["secretName"]
    (mount,) = container["volumeMounts"]
    assert env["LAMPDIST_SECRET_FILE"].startswith(mount["mountPath"] + "/")


def test_the_doc_says_how_to_make_the_secret_and_that_no_cluster_runs_in_the_tests() -> None:
    text = " ".join(section().split())
    secret_name = manifest()["Job"]["spec"]["template"]["spec"]["volumes"][0]["secret"]
    assert f"kubectl create secret generic {secret_name['secretName']}" in text
    assert "No Kubernetes cluster runs in lampdist's tests" in text


@pytest.mark.parametrize("index", [0, 2])
@pytest.mark.parametrize("stored", [b"s3cr3t-hex", b"s3cr3t-hex\n"])
def test_from_env_reads_a_pods_environment(tmp_path: Path, index: int, stored: bytes) -> None:
    environ = pod_environment(index, {"secret": stored}, tmp_path)
    env = lampdist.launch.from_env(environ)
    assert (env.rank, env.nranks, env.local_rank) == (index, 3, 0)
    assert env.is_root == (index == 0)
    assert env.host == "run-42-0.run-42"
    assert env.port == 29501
    assert env.port_exchange is None
    assert env.secret == b"s3cr3t-hex"  # the file's one trailing newline stripped
    assert str(env.device) == "cpu"
