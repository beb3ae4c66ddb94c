"""deploy/kubernetes offline: each deployment of its prefect.yaml rendered into the Kubernetes Job a
worker would create, through prefect-kubernetes' own code (flows/kubernetes.py: KubernetesWorkerJobConfiguration
.resolve_for_flow_run, as the worker calls it for a flow run, and `grpo k8s render`), with no Prefect API and
no cluster.
The manifest must deserialize into a V1Job with no field the model does not know (kubernetes_asyncio:
the client prefect-kubernetes creates jobs with; the same generated models as `kubernetes`)."""

import asyncio
import json
import re
import tomllib

import pytest
import yaml

pytest.importorskip("prefect_kubernetes", reason="prefect-kubernetes not installed: pip install -e '.[kubernetes]'")

from kubernetes_asyncio.client import ApiClient, V1Job  # noqa: E402 (prefect-kubernetes' client)
from kubernetes_asyncio.client import models as k8s_models  # noqa: E402
from prefect.server.schemas.actions import WorkPoolCreate  # noqa: E402
from prefect.utilities.schema_tools import validate  # noqa: E402
from prefect_kubernetes.worker import KubernetesWorker  # noqa: E402

from flows.cli import main  # noqa: E402
from flows.kubernetes import DEPLOY, deployments, render_job  # noqa: E402
from grpo.record.layout import STAGES  # noqa: E402

TEMPLATE = json.loads((DEPLOY / "base-job-template.json").read_text())
DEPLOYMENTS = deployments(DEPLOY / "prefect.yaml")
PLACEMENT = DEPLOYMENTS["grpo/k8s-placed"]["parameters"]["placement"]
NEEDS_GPU = {"rollouts", "learn", "eval"}  # sampling and the update; the other stages only read and write files
SECRET_ENV = {"GRPO_STORAGE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"}
# prefect-kubernetes requires these two Job fields in the pod spec; the API server ignores them (a warning at most)
PREFECT_EXTRAS = {"spec.template.spec.parallelism", "spec.template.spec.completions"}


def render(deployment: dict, parameters: dict | None = None) -> dict:
    """The Job manifest a kubernetes worker of the deployment's pool creates for a flow run of it."""
    return render_job(deployment, TEMPLATE, parameters)


async def as_v1job(manifest: dict) -> V1Job:
    """The manifest through the kubernetes client's own deserializer (required fields checked)."""
    async with ApiClient() as api:
        return api._ApiClient__deserialize(manifest, "V1Job")


def unknown_fields(data, kind: str, at: str = "") -> list[str]:
    """Paths in `data` that the kubernetes model `kind` ('V1Job', 'list[V1EnvVar]', ...) has no field for."""
    if m := re.fullmatch(r"list\[(.*)\]", kind):
        return [p for i, item in enumerate(data) for p in unknown_fields(item, m.group(1), f"{at}[{i}]")]
    if m := re.fullmatch(r"dict\(str, (.*)\)", kind):
        return [p for k, v in data.items() for p in unknown_fields(v, m.group(1), f"{at}.{k}")]
    model = getattr(k8s_models, kind, None)
    if model is None:  # str, int, object, ...
        return []
    fields = {json_name: model.openapi_types[attr] for attr, json_name in model.attribute_map.items()}
    out = []
    for key, value in data.items():
        path = f"{at}.{key}".lstrip(".")
        if key not in fields:
            out.append(path)
        elif value is not None:
            out += unknown_fields(value, fields[key], path)
    return out


def check_job(manifest: dict, variables: dict) -> None:
    """The Job is a valid V1Job with the resources and placement of `variables`, storage from the Secret."""
    assert [p for p in unknown_fields(manifest, "V1Job") if p not in PREFECT_EXTRAS] == []
    job = asyncio.run(as_v1job(manifest))
    assert isinstance(job, V1Job) and job.kind == "Job" and job.api_version == "batch/v1"

    pod = job.spec.template.spec
    (container,) = pod.containers
    assert container.image == variables["image"]
    assert container.args == ["prefect", "flow-run", "execute"]
    # the manifest holds the integer 1, which the API server reads as the quantity "1"
    limits, requests = container.resources.limits, container.resources.requests
    if "gpus" in variables:
        assert limits["nvidia.com/gpu"] == str(variables["gpus"]) == "1"
    else:
        assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in requests
    assert requests == {"cpu": variables["cpu"], "memory": variables["memory"]}
    assert limits["memory"] == variables["memory"] and "cpu" not in limits
    assert pod.node_selector == variables["node_selector"] and pod.node_selector
    assert [t.key for t in pod.tolerations or []] == [t["key"] for t in variables.get("tolerations", [])]
    assert pod.restart_policy == "Never"
    shm = {v.name: v for v in pod.volumes}["dshm"]
    assert shm.empty_dir.medium == "Memory" and "/dev/shm" in [m.mount_path for m in container.volume_mounts]

    # storage settings come from the Secret, by reference; no literal value of them in the Job
    env = {e.name: e for e in container.env}
    assert SECRET_ENV <= set(env)
    for key in SECRET_ENV:
        assert env[key].value is None and env[key].value_from, f"{key}: a literal value, not the Secret's"
        ref = env[key].value_from.secret_key_ref
        assert (ref.name, ref.key) == ("grpo-storage", key)
        assert ref.optional is (None if key == "GRPO_STORAGE" else True)  # no storage URL: the pod does not start
    for e in container.env:
        assert e.value is None or not re.search(r"SECRET|ACCESS_KEY|PASSWORD|TOKEN|GRPO_STORAGE", e.name), e.name
    assert env["PREFECT__FLOW_RUN_ID"].value  # the worker's own variables are still there


def test_the_template_is_a_valid_kubernetes_work_pool_template():
    WorkPoolCreate(name="grpo-k8s-gpu", type="kubernetes", base_job_template=TEMPLATE)  # the server's check
    ours = set(TEMPLATE["variables"]["properties"])
    standard = set(KubernetesWorker.get_default_base_job_template()["variables"]["properties"])
    assert standard - ours == {"cpu_request", "cpu_limit", "memory_request", "memory_limit"}  # -> cpu, memory


def test_the_commands_create_every_pool_and_run_the_deployments():
    text = (DEPLOY / "prefect.yaml").read_text()
    for d in DEPLOYMENTS.values():
        assert f"prefect work-pool create {d['work_pool']['name']} --type kubernetes --base-job-template" in text
    assert "prefect deployment run grpo/k8s-gpu" in text


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_job_variables_are_the_pools_variables(name):
    """What the server checks when a flow run is created: the job variables fit the pool's schema."""
    variables = DEPLOYMENTS[name]["work_pool"]["job_variables"]
    schema = TEMPLATE["variables"]
    assert set(variables) <= set(schema["properties"]), "a misspelled variable would be silently ignored"
    defaults = {k: p["default"] for k, p in schema["properties"].items() if p.get("default") is not None}
    validate({**defaults, **variables}, schema, raise_on_error=True, preprocess=True, allow_none_with_default=True)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_renders_a_job_with_its_resources_and_the_secret(name):
    deployment = DEPLOYMENTS[name]
    check_job(render(deployment), deployment["work_pool"]["job_variables"])


@pytest.mark.parametrize("stage", STAGES)
def test_each_placed_stage_renders_a_job_on_its_pool(stage):
    """grpo/k8s-placed runs a stage as a flow run of grpo-stage/<pool> (flows.placement.Placement): a GPU
    pod for sampling and the update, a CPU pod for the rest."""
    pool = PLACEMENT[stage]
    deployment = DEPLOYMENTS[f"grpo-stage/{pool}"]
    assert deployment["work_pool"]["name"] == pool
    variables = deployment["work_pool"]["job_variables"]
    assert ("gpus" in variables) == (stage in NEEDS_GPU)
    params = {"storage_url": "s3://bucket/runs", "run_id": "k1", "iteration": 0, "stage": stage}
    check_job(render(deployment, params), variables)


def test_a_literal_storage_setting_in_job_variables_fails_the_check():
    deployment = DEPLOYMENTS["grpo/k8s-gpu"]
    variables = {**deployment["work_pool"]["job_variables"], "env": {"AWS_SECRET_ACCESS_KEY": "abc"}}
    manifest = render({**deployment, "work_pool": {**deployment["work_pool"], "job_variables": variables}})
    with pytest.raises(AssertionError, match="AWS_SECRET_ACCESS_KEY: a literal value"):
        check_job(manifest, variables)


def test_the_image_copies_every_package():
    pyproject = tomllib.loads((DEPLOY.parent.parent / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+)/ ", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE))
    assert packages <= copied


def test_every_stage_is_placed():
    assert set(PLACEMENT) == set(STAGES)


def render_cli(capsys, *args) -> tuple[int, list[tuple[str, dict]], str]:
    """`grpo k8s render ...`: (exit code, [(the comment line, the Job)], stderr)."""
    code = main(["k8s", "render", *args])
    out = capsys.readouterr()
    docs = [d for d in out.out.split("---\n") if d.strip()]
    return code, [(d.splitlines()[0], yaml.safe_load(d)) for d in docs], out.err


def test_k8s_render_prints_each_stages_job_as_a_worker_would_create_it(capsys):
    code, jobs, err = render_cli(capsys, "--run", "r7", "--iteration", "3")
    assert code == 0 and err == ""
    assert [c for c, _ in jobs] == [f"# stage {s}: a flow run of deployment grpo-stage/{PLACEMENT[s]}" for s in STAGES]
    for stage, (_, job) in zip(STAGES, jobs):
        check_job(job, DEPLOYMENTS[f"grpo-stage/{PLACEMENT[stage]}"]["work_pool"]["job_variables"])
        limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (stage in NEEDS_GPU)
        assert job["metadata"]["generateName"] == f"r7-{stage}-3-"
    assert render_cli(capsys, "--run", "r7", "--iteration", "3")[1] == jobs  # placeholder ids: the same YAML again


def test_k8s_render_one_stage_or_a_deployment_and_a_wrong_name_in_one_line(capsys):
    code, jobs, _ = render_cli(capsys, "--stage", "learn")
    assert code == 0 and [c for c, _ in jobs] == ["# stage learn: a flow run of deployment grpo-stage/grpo-k8s-gpu"]
    code, jobs, _ = render_cli(capsys, "--deployment", "grpo/k8s-gpu")
    assert code == 0 and [c for c, _ in jobs] == ["# deployment grpo/k8s-gpu: a flow run on pool grpo-k8s-gpu"]
    check_job(jobs[0][1], DEPLOYMENTS["grpo/k8s-gpu"]["work_pool"]["job_variables"])
    code, jobs, err = render_cli(capsys, "--deployment", "grpo/k8s-cpu")
    assert code == 2 and jobs == [] and err.count("\n") == 1
    assert "--deployment grpo/k8s-cpu: " in err and "grpo/k8s-gpu, grpo/k8s-placed" in err
