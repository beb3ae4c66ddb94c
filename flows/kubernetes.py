"""`grpo k8s render`: the Kubernetes Job a worker of deploy/kubernetes' pools creates for a flow run, rendered
offline through prefect-kubernetes' own code (KubernetesWorkerJobConfiguration.resolve_for_flow_run, as the
worker calls it), with no Prefect API and no cluster.

    grpo k8s render                  # each stage's Job under grpo/k8s-placed's placement, as YAML
    grpo k8s render --stage learn    # one stage's
    grpo k8s render --deployment grpo/k8s-gpu

The flow run's ids are placeholders (uuid5 of its names, so two renders print the same YAML): the Job is there
to read and diff, not to apply; a worker makes the real one for each flow run.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import yaml

from grpo.errors import StageError
from grpo.record.layout import STAGES

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
PREFECT_FILE = DEPLOY / "prefect.yaml"
FLOWS = {"flows.grpo:grpo": "grpo", "flows.placement:stage_flow": "grpo-stage"}  # entrypoint -> flow name
PLACED = "grpo/k8s-placed"  # the deployment whose `placement` parameter puts each stage on a pool


def deployments(prefect_file: str | Path = PREFECT_FILE) -> dict[str, dict]:
    """The deployments of a prefect.yaml by their full name (`grpo-stage/grpo-k8s-gpu`)."""
    try:
        found = yaml.safe_load(Path(prefect_file).read_text())["deployments"]
        return {f"{FLOWS[d['entrypoint']]}/{d['name']}": d for d in found}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise StageError(
            f"{prefect_file}: not a prefect.yaml of grpo-flow deployments ({type(e).__name__}: {e})"
        ) from e


def job_template(prefect_file: str | Path = PREFECT_FILE) -> dict:
    """The work pools' base job template: base-job-template.json beside the prefect.yaml."""
    path = Path(prefect_file).with_name("base-job-template.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: the pools' base job template does not read ({type(e).__name__}: {e})") from e


class OfflineClient:
    """Stands in for the PrefectClient: answers the one read resolve_for_flow_run makes (the flow); anything else
    would be a call to a Prefect API that rendering must not need."""

    def __init__(self, flow):
        self.flow = flow

    async def read_flow(self, flow_id):
        return self.flow

    def __getattr__(self, name):
        raise RuntimeError(f"rendering the job called the Prefect API: {name}")


def render_job(deployment: dict, template: dict, parameters: dict | None = None, run_name: str = "k1") -> dict:
    """The Job manifest a kubernetes worker of the deployment's pool creates for a flow run of it named `run_name`
    with `parameters` (over the deployment's own)."""
    try:
        from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
        from prefect.client.schemas.responses import DeploymentResponse
        from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration
    except ImportError as e:
        raise StageError(f"grpo k8s render needs prefect-kubernetes ({e}): pip install -e '.[kubernetes]'") from e

    def placeholder(*names) -> uuid.UUID:
        return uuid.uuid5(uuid.NAMESPACE_URL, "grpo-flow/" + "/".join(map(str, names)))

    pool, name = deployment["work_pool"], deployment["name"]
    flow = Flow(id=placeholder("flow", deployment["entrypoint"]), name=FLOWS[deployment["entrypoint"]])
    dep = DeploymentResponse(
        id=placeholder("deployment", flow.name, name),
        name=name,
        flow_id=flow.id,
        entrypoint=deployment["entrypoint"],
        parameters=deployment.get("parameters", {}),
        work_pool_name=pool["name"],
        job_variables=pool.get("job_variables", {}),
    )
    run = FlowRun(
        id=placeholder("flow-run", flow.name, name, run_name),
        name=run_name,
        flow_id=flow.id,
        deployment_id=dep.id,
        parameters={**dep.parameters, **(parameters or {})},
    )
    work_pool = WorkPool(
        id=placeholder("work-pool", pool["name"]), name=pool["name"], type="kubernetes", base_job_template=template
    )
    config = asyncio.run(
        KubernetesWorkerJobConfiguration.resolve_for_flow_run(
            run, client=OfflineClient(flow), work_pool=work_pool, worker_name="grpo-k8s-render", deployment=dep
        )
    )
    return config.job_manifest


def stage_jobs(
    stages=STAGES, run_id: str = "k1", iteration: int = 0, prefect_file: str | Path = PREFECT_FILE
) -> dict[str, tuple[str, dict]]:
    """{stage: (deployment name, Job manifest)}: the Job of each stage's flow run under grpo/k8s-placed's placement
    (a flow run of grpo-stage/<pool>, as flows.placement.Placement starts it)."""
    found, template = deployments(prefect_file), job_template(prefect_file)
    if PLACED not in found:
        raise StageError(f"{prefect_file}: no deployment {PLACED}, whose placement puts each stage on a pool")
    placement = found[PLACED]["parameters"]["placement"]
    jobs = {}
    for stage in stages:
        name = f"grpo-stage/{placement[stage]}"
        params = {"run_id": run_id, "iteration": iteration, "stage": stage}
        jobs[stage] = name, render_job(found[name], template, params, f"{run_id}-{stage}-{iteration}")
    return jobs


def as_yaml(jobs: list[tuple[str, dict]]) -> str:
    """Job manifests as one YAML stream, each document after a comment line saying what it is."""
    return "".join(
        f"---\n# {what}\n" + yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)
        for what, manifest in jobs
    )
